"""Triton kernels against their torch references (RMSNorm, residual + RMSNorm, SiLU-and-mul,
q/k norm + rotary + KV-cache store), and the dispatch between them.

Without a GPU the kernels run in Triton's interpreter on small shapes (see
``triton_interpret.py``); with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import kernel_device, run_compiler_script

from engine.common.config import RopeConfig
from engine.layers.rope import build_cos_sin_cache
from kernels import dispatch
from kernels.activation import reference as activation
from kernels.norm import reference as rms_norm
from kernels.rotary import reference as rotary
from kernels.switches import using

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a few ulps of the largest value (the kernels round like the eager ops;
    only the order of a norm's sum of squares differs). A wrong index or mask is off by
    the values themselves."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = max(1.0, float(ref.float().abs().max()))
    tol = (2e-6 if ref.dtype == torch.float32 else 2**-7) * scale
    diff = float((out.float() - ref.float()).abs().max())
    assert diff <= tol, f"max |diff| {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 200), (5, 4, 32)])
def test_rms_norm(dev, dtype, shape):
    from kernels.norm import triton_kernel as triton_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).to(dev)
    w = torch.randn(shape[-1], generator=g).to(dtype).to(dev)
    assert_close(triton_norm.rms_norm(x, w, 1e-6), rms_norm.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (9, 96), (4, 576)])
def test_fused_add_rms_norm_updates_the_residual_in_place(dev, dtype, tokens, hidden):
    from kernels.norm import triton_kernel as triton_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
    res = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
    w = torch.randn(hidden, generator=g).to(dtype).to(dev)
    res_ref = res.clone()
    x_before = x.clone()
    out, r = triton_norm.fused_add_rms_norm(x, res, w, 1e-5)
    out_ref, r_ref = rms_norm.fused_add_rms_norm(x, res_ref, w, 1e-5)
    assert r is res  # in place
    assert torch.equal(x, x_before)
    assert_close(r, r_ref)
    assert_close(out, out_ref)


def test_fused_add_rms_norm_refuses_a_strided_residual(dev):
    from kernels.norm import triton_kernel as triton_norm

    x = torch.randn(4, 8, device=dev)
    res = torch.randn(8, 4, device=dev).t()
    with pytest.raises(ValueError, match="contiguous last dimension"):
        triton_norm.fused_add_rms_norm(x, res, torch.ones(8, device=dev), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 37), (5, 128), (2, 1500)])
def test_silu_and_mul(dev, dtype, tokens, inter):
    from kernels.activation import triton_kernel as triton_activation

    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)
    assert_close(triton_activation.silu_and_mul(x), activation.silu_and_mul(x))


LLAMA3 = RopeConfig(
    theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def _paged_slots(num_tokens: int, page_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of a sequence's last ``num_tokens`` tokens over shuffled pages, starting
    mid-page so the run crosses page boundaries; and their positions."""
    start = 3
    pages = torch.randperm(16, generator=g)[: (start + num_tokens) // page_size + 1] + 1  # page 0 is null
    pos = torch.arange(start, start + num_tokens)
    return pages[pos // page_size] * page_size + pos % page_size, pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa4", "gqa8"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
def test_rotary_and_store(dev, dtype, head_dim, heads, qk_norm):
    from kernels.rotary import triton_kernel as triton_rotary

    hq, hk = heads
    g = torch.Generator().manual_seed(head_dim + hq + hk)
    page_size, num_tokens = 4, 7 if qk_norm else 5  # odd lengths over page boundaries
    rope = LLAMA3 if head_dim == 128 else RopeConfig(theta=10000.0)
    cache = build_cos_sin_cache(rope, head_dim, 64).to(dev)
    # q/k/v as views into one fused projection output, as the model passes them.
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, generator=g).to(dtype).to(dev)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q = q.view(num_tokens, hq, head_dim)
    k = k.view(num_tokens, hk, head_dim)
    v = v.view(num_tokens, hk, head_dim)
    slots, positions = _paged_slots(num_tokens, page_size, g)
    slots, positions = slots.to(dev), positions.to(dev)
    pool_shape = (17 * page_size, hk, head_dim)
    k_cache = torch.randn(pool_shape, generator=g).to(dtype).to(dev)
    v_cache = torch.randn(pool_shape, generator=g).to(dtype).to(dev)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qw = kw = None
    if qk_norm:
        qw = torch.randn(head_dim, generator=g).to(dtype).to(dev)
        kw = torch.randn(head_dim, generator=g).to(dtype).to(dev)
    qkv_before = qkv.clone()

    out = triton_rotary.rotary_and_store(q, k, v, positions, cache, k_cache, v_cache, slots, qw, kw, 1e-6)
    ref = rotary.rotary_and_store(q, k, v, positions, cache, k_ref, v_ref, slots, qw, kw, 1e-6)

    assert out.is_contiguous()
    assert_close(out, ref)
    assert_close(k_cache, k_ref)  # written slots close, every other slot untouched
    assert torch.equal(v_cache, v_ref)  # values are copied, not computed
    assert torch.equal(qkv, qkv_before)


def test_rotary_and_store_without_tokens(dev):
    from kernels.rotary import triton_kernel as triton_rotary

    q = torch.empty(0, 2, 64, device=dev)
    k = torch.empty(0, 1, 64, device=dev)
    buf = torch.zeros(8, 1, 64, device=dev)
    cache = build_cos_sin_cache(RopeConfig(), 64, 8).to(dev)
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    assert triton_rotary.rotary_and_store(q, k, k, empty, cache, buf, buf, empty).shape == (0, 2, 64)
    assert not buf.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (3, 200, 40), (16, 96, 130)])
def test_gemv_matches_its_reference(dev, dtype, rows, k, n, monkeypatch):
    """Decode-sized projections: odd widths (masked tiles), up to the 16-row tile."""
    from kernels.gemv import reference as gemv
    from kernels.gemv import triton_kernel as triton_gemv

    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(dev, dtype)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dev, dtype)
    with using(gemv=True):  # --gemv
        assert_close(triton_gemv.linear(x, w), gemv.linear(x, w))
        assert_close(triton_gemv.gate_up_silu(x, w), gemv.gate_up_silu(x, w))


def test_gemv_leaves_larger_steps_and_float32_to_the_reference(dev, monkeypatch):
    from kernels.gemv import reference as gemv
    from kernels.gemv import triton_kernel as triton_gemv

    x, w = torch.randn(17, 32, device=dev), torch.randn(24, 32, device=dev)
    with using(gemv=True):  # --gemv
        assert torch.equal(triton_gemv.linear(x, w), gemv.linear(x, w))
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        assert torch.equal(triton_gemv.linear(xb, wb), gemv.linear(xb, wb))  # 17 rows: cuBLAS's
        assert triton_gemv.gate_up_silu(x[:4], w).shape == (4, 12)


def test_dispatch_uses_the_reference_on_cpu(monkeypatch):
    """CPU tensors always take the torch path, even with triton installed; the Triton
    module is only imported for CUDA tensors."""
    x = torch.randn(3, 16)
    w = torch.randn(16)
    assert not dispatch.use_triton(x)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), rms_norm.rms_norm(x, w, 1e-6))
    assert torch.equal(dispatch.silu_and_mul(x), activation.silu_and_mul(x))
    assert set(dispatch.KERNELS) == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_store", "linear",
                                     "gate_up_silu", "fused_moe", "fused_moe_quant"}
    for kernel in dispatch.KERNELS.values():  # every Triton twin exists with that name
        pytest.importorskip("triton")
        assert callable(kernel.triton())


def test_headroom_kernels_torch_forces_the_references(monkeypatch):
    """``--kernels torch`` (``HEADROOM_KERNELS=torch``): the references everywhere, read at
    each call, CUDA tensors included."""
    monkeypatch.setattr(dispatch, "_triton_imports", lambda: True)
    with using(kernels="torch"):
        assert not dispatch.triton_available()
    assert dispatch.triton_available()


def test_kernels_compile_for_hopper_without_a_gpu():
    """Compile every kernel for sm_90 in a child process (see triton_compile_check.py)."""
    pytest.importorskip("triton")
    done = run_compiler_script("triton_compile_check.py", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sampling ok" in done.stdout


def test_kernel_switches_take_the_usual_words_and_refuse_others():
    """``HEADROOM_QUANT_INT8`` and the other kernel switches: unset (or empty) means the
    default, 1/true/yes/on and 0/false/no/off (any case) are read, anything else is
    refused with the variable and the accepted words named (a typo must not silently
    mean on); the same words through serve's settings, whose message names the
    variable too."""
    from engine.common.environment import kernel_switches
    from kernels.switches import KernelSwitches
    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

    assert kernel_switches({}) == KernelSwitches() == kernel_switches({"HEADROOM_QUANT_INT8": ""})
    for default in (True, False):
        for word, value in (("1", True), ("On", True), ("yes", True), ("FALSE", False), ("off", False), ("0", False)):
            name = "quant_int8" if default else "quant_int8_fuse"
            assert getattr(kernel_switches({f"HEADROOM_{name.upper()}": word}), name) is value
    assert kernel_switches({"HEADROOM_KERNELS": "Torch"}).kernels == "torch"
    with pytest.raises(ValueError, match=r"HEADROOM_QUANT_INT8='abc' is not a value of --quant-int8: use 1/0, true/false"):
        kernel_switches({"HEADROOM_QUANT_INT8": "abc"})
    with pytest.raises(ValueError, match=r"HEADROOM_KERNELS='tritn' is not a value of --kernels: use auto, torch"):
        kernel_switches({"HEADROOM_KERNELS": "tritn"})
    with pytest.raises(SettingsError, match=r'environment HEADROOM_QUANT_INT8: quant_int8 = "abc" is not a valid boolean '
                                            r"\(use true/false, on/off, yes/no or 1/0\)"):
        resolve({}, env={"HEADROOM_CONFIG": "/dev/null", "HEADROOM_QUANT_INT8": "abc"})
