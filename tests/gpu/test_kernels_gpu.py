"""Compiled Triton kernels on CUDA: real model widths, the sampler's GPU path, no host
sync in a decode step, and fewer launches per step than the eager references.

(tests/test_kernels.py and tests/test_sampling_kernels.py also run compiled here; these
add the shapes and checks the interpreter cannot afford.)
"""

from __future__ import annotations

import pytest
import torch

from engine.common.config import RopeConfig
from engine.layers.rope import build_cos_sin_cache
from engine.loader.load import load_model
from engine.sampling.sampler import InvalidLogitsError, Sampler
from engine.sampling.state import SamplingState
from engine.wire.messages import SamplingParams as SP
from kernels import dispatch
from kernels.activation import reference as activation
from kernels.norm import reference as rms_norm
from kernels.rotary import reference as rotary

DEV = "cuda"
BF16 = torch.bfloat16


def _close_and_mostly_equal(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within two bfloat16 ulps of the largest value, and bit-equal almost everywhere:
    compiled kernels round like the eager ops, only reduction orders differ."""
    scale = max(1.0, float(ref.float().abs().max()))
    diff = float((out.float() - ref.float()).abs().max())
    equal = float((out == ref).float().mean())
    print(f"{what}: max |diff| {diff:.3g}, bit-equal share {equal:.5f}")
    assert diff <= 2**-6 * scale
    assert equal >= 0.99


def test_fused_add_rms_norm_at_model_width():
    from kernels.norm import triton_kernel as triton_norm

    x = torch.randn(257, 4096, device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    res_ref = res.clone()
    out, _ = triton_norm.fused_add_rms_norm(x, res, w, 1e-5)
    out_ref, _ = rms_norm.fused_add_rms_norm(x, res_ref, w, 1e-5)
    assert torch.equal(res, res_ref)  # one rounding each side: exact
    _close_and_mostly_equal(out, out_ref, "add + RMSNorm 257x4096")


def test_silu_and_mul_at_model_width():
    from kernels.activation import triton_kernel as triton_activation

    x = torch.randn(65, 2 * 14336, device=DEV, dtype=BF16)
    _close_and_mostly_equal(triton_activation.silu_and_mul(x), activation.silu_and_mul(x), "SiLU-and-mul 65x14336")


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k,n", [(576, 960), (1024, 4096), (3072, 1024), (4096, 14336)])
def test_gemv_at_model_widths(rows, k, n, monkeypatch):
    """The decode projections (SmolLM2 q/k/v, Qwen3-0.6B q/k/v and MLP down, Llama-3-8B
    gate/up) against cuBLAS: both accumulate in float32 and round once."""
    from kernels.gemv import reference as gemv
    from kernels.gemv import triton_kernel as triton_gemv
    from kernels.switches import using

    x = torch.randn(rows, k, device=DEV, dtype=BF16)
    w = torch.randn(2 * n, k, device=DEV, dtype=BF16) / k**0.5
    with using(gemv=True):  # --gemv
        _close_and_mostly_equal(triton_gemv.linear(x, w[:n]), gemv.linear(x, w[:n]), f"linear {rows}x{k}->{n}")
        _close_and_mostly_equal(triton_gemv.gate_up_silu(x, w), gemv.gate_up_silu(x, w),
                                f"gate/up + SiLU {rows}x{k}->{n}")


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_and_store_at_llama3_8b_shape(qk_norm):
    from kernels.rotary import triton_kernel as triton_rotary

    hq, hk, d, tokens, page = 32, 8, 128, 300, 16
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)
    cache = build_cos_sin_cache(rope, d, 131072, DEV)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=DEV, dtype=BF16)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
    pages = torch.randperm(999, device=DEV)[:19] + 1
    pos = torch.arange(100_000, 100_000 + tokens, device=DEV)  # long-context rows
    slots = pages[(pos - 100_000) // page] * page + pos % page
    kc = torch.randn(1000 * page, hk, d, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    kr, vr = kc.clone(), vc.clone()
    qw = torch.randn(d, device=DEV, dtype=BF16) if qk_norm else None
    kw = torch.randn(d, device=DEV, dtype=BF16) if qk_norm else None
    out = triton_rotary.rotary_and_store(q, k, v, pos, cache, kc, vc, slots, qw, kw, 1e-6)
    ref = rotary.rotary_and_store(q, k, v, pos, cache, kr, vr, slots, qw, kw, 1e-6)
    _close_and_mostly_equal(out, ref, f"rotary q (qk_norm={qk_norm})")
    _close_and_mostly_equal(kc, kr, f"rotary k cache (qk_norm={qk_norm})")
    assert torch.equal(vc, vr)


def test_sampler_gpu_path_at_qwen_vocab():
    V, B = 151936, 64
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(B, V, device=DEV, generator=g) * 4
    mix = [SP(temperature=0.0), SP(temperature=0.8, top_k=50, top_p=0.95, seed=5),
           SP(temperature=1.0, min_p=0.1, seed=6), SP(temperature=0.0, repetition_penalty=1.3)]
    params = [mix[i % 4] for i in range(B)]
    states = [SamplingState(p, [1, 2, 3], V, DEV) for p in params]
    tokens = Sampler().sample(logits, states, params)
    assert tokens.device.type == "cpu" and tokens.dtype == torch.int64  # read back once
    penalized = Sampler.penalize(logits, states, params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert tokens[greedy].tolist() == penalized[greedy].argmax(dim=-1).tolist()

    # A seeded row gives the same token alone and anywhere in the batch.
    alone = Sampler().sample(logits[1:2], states[1:2], params[1:2])
    assert int(alone[0]) == int(tokens[1])

    logits[3, 10] = float("nan")
    with pytest.raises(InvalidLogitsError) as err:
        Sampler().sample(logits, states, params)
    assert err.value.rows == [3]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, make_tiny_hf_model):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_hf_model("qwen3", path, vocab_size=512, hidden_size=256, intermediate_size=512,
                       num_attention_heads=8, num_key_value_heads=2)
    return path


def _runner(path, paged_runner, dtype):
    model, config = load_model(path, DEV, dtype)
    return paged_runner(model, config, page_size=16, num_pages=32, device=DEV)


def test_triton_model_matches_the_reference_kernels(tiny_qwen3, paged_runner, monkeypatch):
    """Same model, same steps, fused Triton kernels vs the torch references, float32."""
    ids = list(range(3, 40))
    out = {}
    for kind in ("triton", "torch"):
        if kind == "torch":
            monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
        runner = _runner(tiny_qwen3, paged_runner, torch.float32)
        steps = [runner.step({0: ids[:20], 1: ids[:9]})]
        steps += [runner.step({0: [ids[20 + i]], 1: [ids[9 + i]]}) for i in range(5)]
        out[kind] = torch.stack(steps)
    diff = float((out["triton"] - out["torch"]).abs().max())
    assert diff <= 1e-4 * max(1.0, float(out["torch"].abs().max()))


def test_decode_step_and_sampling_read_nothing_back(tiny_qwen3, paged_runner):
    """With the step's metadata prepared, a decode forward and the device sampler run
    under CUDA's sync debug mode set to error: no host sync, so a graph can hold them."""
    runner = _runner(tiny_qwen3, paged_runner, BF16)
    runner.step({0: list(range(3, 30)), 1: list(range(5, 12))})
    runner.step({0: [7], 1: [8]})  # warm: kernels built, allocator blocks cached
    batch = runner.last_batch
    runner.attn.prepare(batch)
    runner.attn.prepare = lambda batch: None  # the backend's metadata is not under test
    params = [SP(temperature=0.0), SP(temperature=0.7, top_p=0.9, seed=3)]
    states = [SamplingState(p, [1], 512, DEV) for p in params]
    sampler = Sampler().device_sampler(torch.device(DEV))
    sampler.load(states, params, 512)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.model(batch, runner.attn)
        tokens = sampler.sample_on_device(logits, states, params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tokens.shape == (2,) and tokens.is_cuda


def _kernels_per_step(runner, step) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_fused_kernels_cut_launches_per_decode_step(tiny_qwen3, paged_runner, monkeypatch):
    counts = {}
    for kind in ("triton", "torch"):
        if kind == "torch":
            monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
        runner = _runner(tiny_qwen3, paged_runner, BF16)
        runner.step({0: list(range(3, 30))})
        runner.step({0: [5]})
        counts[kind] = _kernels_per_step(runner, lambda r=runner: r.step({0: [6]}))
    layers = 2
    print(f"GPU kernels per decode step ({layers} layers, torch attention): "
          f"fused Triton {counts['triton']}, torch references {counts['torch']}")
    assert counts["triton"] < counts["torch"]
