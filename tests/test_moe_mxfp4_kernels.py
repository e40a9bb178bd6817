"""gpt-oss's experts in MXFP4 blocks through the Triton fused MoE (grouped GEMV for decode,
sorted GEMM for prefill) against the torch reference, which dequantizes each routed
expert through ``gguf``: the biases of gate/up and down added and the clamped SwiGLU
applied in the kernels' epilogues, over odd token counts and eight experts, the clamp low
enough to bite. Without a GPU the kernels run in Triton's interpreter on float32
activations (the two sides then differ by summation order only); the bfloat16 twin is in
``tests/gpu/test_moe_quant_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from test_moe_quant_kernels import _case, assert_matches
from triton_interpret import kernel_device

from kernels.activation.reference import ClampedSwiGLU
from kernels.moe import quant_reference
from kernels.moe.reference import ExpertBiases

TYPES = ("MXFP4",) * 3
EXPERTS = 8


def gpt_oss_case(tokens: int, dev: str, dtype=torch.float32, seed: int = 0):
    """``(x, (gate, up, down) MXFP4 stacks, weights, ids, biases)`` of :func:`_case`'s
    ``96 x 96`` experts, with random biases in ``dtype``."""
    x, w, weights, ids = _case(TYPES, tokens, EXPERTS, dev, seed, dtype)
    gen = torch.Generator().manual_seed(seed)
    biases = ExpertBiases(torch.randn(EXPERTS, 2 * 96, generator=gen).to(dtype).to(dev),
                          torch.randn(EXPERTS, 96, generator=gen).to(dtype).to(dev))
    return x, w, weights, ids, biases


@pytest.mark.parametrize("tokens,method", [(1, "gemv"), (5, "gemv"), (37, "gemm")])
def test_biases_and_clamped_swiglu_match_the_reference(tokens, method):
    from kernels.moe import quant_triton_kernel

    dev = kernel_device()
    x, w, weights, ids, biases = gpt_oss_case(tokens, dev, seed=tokens)
    act = ClampedSwiGLU(1.702, 7.0)
    ref = quant_reference.fused_moe_quant(x, *w, TYPES, weights, ids, biases=biases, activation=act)
    out = quant_triton_kernel.fused_moe_quant(x, *w, TYPES, weights, ids, method=method, block_n=64, block_m=16,
                                              biases=biases, activation=act)
    assert_matches(out, ref, 1e-5)
    # The clamp bit: without it the reference differs.
    unclamped = quant_reference.fused_moe_quant(x, *w, TYPES, weights, ids, biases=biases,
                                                activation=ClampedSwiGLU(1.702, 1e9))
    assert float((unclamped - ref).abs().max()) > 1e-2 * float(ref.abs().max())


@pytest.mark.parametrize("biased", [True, False], ids=["biases", "plain"])
def test_silu_experts_with_and_without_biases_match_the_reference(biased):
    """SiLU-and-mul over MXFP4 blocks, with biases and without (each epilogue part on its
    own), the grouped GEMV and the sorted GEMM."""
    from kernels.moe import quant_triton_kernel

    dev = kernel_device()
    for tokens in (3, 21):
        x, w, weights, ids, biases = gpt_oss_case(tokens, dev, seed=9)
        biases = biases if biased else None
        ref = quant_reference.fused_moe_quant(x, *w, TYPES, weights, ids, biases=biases)
        out = quant_triton_kernel.fused_moe_quant(x, *w, TYPES, weights, ids, biases=biases, block_m=16)
        assert_matches(out, ref, 1e-5)


def test_biases_of_another_shape_or_with_a_cache_are_refused():
    x, w, weights, ids, biases = gpt_oss_case(2, "cpu")
    short = ExpertBiases(biases.gate_up[:, :96], biases.down)
    with pytest.raises(ValueError, match=r"expert biases \(8, 96\) and \(8, 96\) are not gate_up \(8, 192\)"):
        quant_reference.fused_moe_quant(x, *w, TYPES, weights, ids, biases=short)
    slot_of = torch.full((EXPERTS,), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="experts with biases are not read from an expert cache"):
        quant_reference.fused_moe_quant(x, *w, TYPES, weights, ids, biases=biases, cache=w, slot_of=slot_of)
