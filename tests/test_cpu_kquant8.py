"""The K-quant row products on 8-bit activation codes (kernels/cpu/kquant8.c, the
``cpu_kquant_act_bits`` switch at 8): the codes against their torch reference, the plain
C, AVX2 and AVX-512 products bit for bit, each against ``gguf``'s dequantizer times the
float activations within the codes' rounding, and a K-quant MoE's logits against the
same file dequantized at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from kernels.cpu.block_gemv import block_gemv, block_gemv_ref, quantize_rows, quantize_rows_ref  # noqa: E402
from kernels.quant import reference  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402
from kernels.switches import using  # noqa: E402

KQUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with what the codes must handle: an outlier (a group's largest value 40 times
    its others), a block 1000 times below its group's largest (its scale stops at 2^-6 of
    the group's) and an all-zero group."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, 3] = 40.0
    x[-1, 32:64] *= 1e-3
    if k >= 512:
        x[0, 256:512] = 0.0
    return x


@pytest.mark.parametrize("k", [256, 768])
def test_the_8_bit_codes_equal_their_reference(lib, k):
    x = _activations(5, k, seed=k)
    codes, scales, sums = quantize_rows(lib, x, bits=8)
    want_codes, want_scales = quantize_rows_ref(x, bits=8)
    assert codes.dtype == torch.int8 and torch.equal(codes.to(torch.int16), want_codes)
    assert torch.equal(scales, want_scales)
    assert torch.equal(sums, codes.view(5, -1, 32).sum(-1, dtype=torch.int32))
    assert int(codes.abs().max()) == 127
    # a group's scales are its largest's divided by powers of two, 2^0 to 2^6
    ratio = torch.log2(scales.view(5, -1, 8).amax(-1, keepdim=True) / scales.view(5, -1, 8))
    finite = torch.isfinite(ratio)
    assert torch.equal(ratio[finite], ratio[finite].round()) and float(ratio[finite].max()) <= 6


def test_8_bit_codes_refuse_rows_that_are_not_whole_groups(lib):
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_rows(lib, torch.randn(1, 288), bits=8)


def test_a_non_finite_value_makes_its_group_nan(lib):
    x = torch.randn(1, 512)
    x[0, 300] = float("inf")
    _, scales, _ = quantize_rows(lib, x, bits=8)
    assert bool(scales[0, 8:].isnan().all()) and bool(scales[0, :8].isfinite().all())


@pytest.mark.parametrize("type_name", KQUANTS)
@pytest.mark.parametrize(("n", "k"), [(37, 768), (13, 256)])
def test_the_8_bit_products_are_the_same_bits_on_every_path_and_within_the_rounding(lib, type_name, n, k):
    """N not a multiple of the tile's rows, 1 and 3 blocks a row, 1 to 5 activation rows:
    the plain C product (the integer arithmetic written out), the AVX2 one and the
    fastest (the AVX-512 tile where the build has it) give the same bits; all equal the
    torch reference on the same codes to float32 summation order, and the float
    activations' product within the codes' rounding: |x - dx c| <= dx / 2 per value, so
    |y - x . w| <= sum over blocks of dx_b / 2 * sum |w| over the block."""
    blocks = torch.from_numpy(random_blocks(type_name, n, k, np.random.default_rng(n * k)))
    w = reference.dequantize(blocks, type_name, k)
    for m in range(1, 6):
        x = _activations(m, k, seed=m)
        with using(cpu_kquant_act_bits="8"):
            plain = block_gemv(lib, x, blocks, type_name, scalar=True)
            with using(cpu_block_gemm=False):
                avx2 = block_gemv(lib, x, blocks, type_name)
            best = block_gemv(lib, x, blocks, type_name)
            want = block_gemv_ref(x, blocks, type_name)
        assert torch.equal(plain, avx2) and torch.equal(plain, best), m
        tol = float((x.abs() @ w.abs().T).max()) * 2e-6
        assert float((plain - want).abs().max()) <= tol, m
        _, dx = quantize_rows_ref(x, bits=8)
        half_step = (dx / 2).repeat_interleave(32, dim=1)
        exact = (x.double() @ w.double().T).float()
        assert bool(((plain - exact).abs() <= half_step @ w.abs().T * 1.001 + tol).all()), m


def test_the_switch_reaches_the_products(lib):
    """At 16 the K-quant products take 16-bit codes (their reference's rounding); at 8,
    8-bit ones: the two differ, each equals its own reference."""
    blocks = torch.from_numpy(random_blocks("Q4_K", 8, 512, np.random.default_rng(1)))
    x = _activations(2, 512, seed=2)
    got = {}
    for bits in ("16", "8"):
        with using(cpu_kquant_act_bits=bits):
            got[bits] = block_gemv(lib, x, blocks, "Q4_K")
            want = block_gemv_ref(x, blocks, "Q4_K", bits=int(bits))
        assert float((got[bits] - want).abs().max()) <= 1e-5 * float(want.abs().max()), bits
    assert not torch.equal(got["16"], got["8"])


# Relative to the largest logit: measured 0.010 (16-bit codes: 4e-5). Each expert
# projection's activations move by dx / 2 a value, 0.6-0.9% of their norm at 8 bits
# (a group's largest / 254), at gate/up and again at down; the tiny model passes that
# on about one to one, so three times the measured value leaves room for other seeds.
LOGITS_TOLERANCE_8 = 0.03


def test_a_k_quant_moe_s_logits_at_8_bits_stay_near_the_dequantized_model(tmp_path, make_tiny_hf_model,
                                                                           paged_runner):
    """The tiny Qwen3-MoE of test_gguf_moe_quant (experts Q4_K/Q4_K/Q6_K in blocks, on
    the C kernels) with 8-bit codes, fed the dequantized model's tokens: logits within
    :data:`LOGITS_TOLERANCE_8` of the largest for 8 steps."""
    from test_gguf_moe_quant import write_tiny_moe_gguf

    from engine.layers.linear.cpu_kernels import cpu_kernels
    from engine.loader.gguf_quant import load_gguf_quantized

    if cpu_kernels() is None:
        pytest.skip("the C CPU kernels do not build here")
    path, config = write_tiny_moe_gguf(tmp_path, make_tiny_hf_model)
    blocks = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    dense = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=False)
    with using(cpu_kquant_act_bits="8"):
        a, b = paged_runner(dense, config), paged_runner(blocks, config)
        ids = [5, 70, 3, 200, 42, 42, 9, 100]
        la, lb = a.step({0: ids})[0], b.step({0: ids})[0]
        for _ in range(8):
            assert float((la - lb).abs().max()) <= LOGITS_TOLERANCE_8 * max(1.0, float(la.abs().max()))
            assert float((la - lb).abs().max()) > 0  # the 8-bit products did run
            token = int(la.argmax())
            la, lb = a.step({0: [token]})[0], b.step({0: [token]})[0]
