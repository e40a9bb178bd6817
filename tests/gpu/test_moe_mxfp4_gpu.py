"""gpt-oss's routed experts kept in MXFP4 blocks on CUDA: the Triton fused MoE over the
blocks (biases and the clamped SwiGLU in its epilogues) against the torch reference over
the same experts dequantized, at gpt-oss-20b's expert shape (hidden and expert width
2880, top-4; 8 of its 32 experts, to keep the reference's dequantization short), bfloat16
activations.

Tolerances as ``test_moe_quant_gpu.py``'s: within 2**-5 of the largest output and 1 % in
relative Frobenius norm (two matmuls and the activation each rounded to bfloat16, the
reference's sums in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.activation.reference import ClampedSwiGLU
from kernels.moe.reference import ExpertBiases, route
from kernels.moe.reference import fused_moe as torch_fused_moe
from kernels.quant.reference import dequantize

HIDDEN = INTER = 2880
EXPERTS, TOP_K = 8, 4


def _mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``block_mxfp4`` rows: random E2M1 codes, E8M0 scales 2**-7 .. 2**-5 (values
    up to about 0.2, as a trained expert's)."""
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(120, 123, size=rows * cols // 32)
    return blocks.reshape(rows, cols // 32 * 17)


@pytest.mark.parametrize("tokens", [1, 7, 16, 301])
def test_mxfp4_experts_with_biases_and_clamp_match_the_reference(tokens):
    from kernels.moe.quant_triton_kernel import fused_moe_quant

    rng = np.random.default_rng(0)
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    blocks = [torch.from_numpy(np.stack([_mxfp4(r, c, rng) for _ in range(EXPERTS)])).cuda() for r, c in shapes]
    gate, up, down = (dequantize(b.reshape(-1, b.shape[-1]), "MXFP4", k).reshape(EXPERTS, -1, k).bfloat16()
                      for b, k in zip(blocks, (HIDDEN, HIDDEN, INTER), strict=True))
    g = torch.Generator(device="cuda").manual_seed(tokens)
    biases = ExpertBiases(torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=g).bfloat16() * 0.5,
                          torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g).bfloat16() * 0.5)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    weights, ids = route(torch.randn(tokens, EXPERTS, device="cuda", generator=g), TOP_K, renormalize=False)
    weights = weights.bfloat16()
    act = ClampedSwiGLU(1.702, 7.0)
    ref = torch_fused_moe(x, torch.cat([gate, up], dim=1), down, weights, ids, biases=biases, activation=act).float()
    for method in ("gemv", "gemm") if tokens <= 16 else ("gemm",):
        out = fused_moe_quant(x, *blocks, ("MXFP4",) * 3, weights, ids, method=method, biases=biases,
                              activation=act).float()
        scale = float(ref.abs().max())
        diff = float((out - ref).abs().max())
        assert diff <= 2**-5 * scale, (tokens, method, diff, scale)
        assert float((out - ref).norm() / ref.norm()) <= 1e-2, (tokens, method)
