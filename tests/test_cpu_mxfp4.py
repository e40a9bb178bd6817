"""The C CPU kernel over MXFP4 blocks (kernels/cpu/mxfp4.c): its row products against gguf's
dequantizer times the activations, on odd shapes; and gpt-oss's experts in one call
(kernels/cpu/moe_experts.c: biases on gate/up and down, the clamped SwiGLU) against
their torch reference, at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kernels.activation.reference import ClampedSwiGLU  # noqa: E402
from kernels.cpu.block_gemv import block_gemv, block_gemv_ref  # noqa: E402
from kernels.cpu.moe_experts import moe_experts, moe_experts_ref  # noqa: E402
from kernels.moe.reference import ExpertBiases  # noqa: E402
from kernels.quant import reference  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402


def _blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks("MXFP4", rows, cols, np.random.default_rng(seed)))


@pytest.mark.parametrize(("rows", "cols", "m"), [(37, 96, 1), (13, 32, 3), (5, 2880, 17)])
def test_mxfp4_gemv_equals_gguf_s_dequantizer_times_the_activations(lib, rows, cols, m):
    """Rows not a multiple of anything, 1-90 blocks a row, 1, 3 and 17 activation rows:
    within float32 summation order of the reference, and within a 16-bit code's rounding
    of the unrounded activations."""
    blocks = _blocks(rows, cols, rows * cols + m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(rows))
    x[0, 3] = 40.0  # an outlier, as real activations have
    w = reference.dequantize(blocks, "MXFP4", cols)
    assert torch.equal(w, torch.from_numpy(gguf.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.MXFP4)))
    tol = float((x.abs() @ w.abs().T).max()) * 2e-6
    got = block_gemv(lib, x, blocks, "MXFP4")
    assert got.shape == (m, rows) and got.dtype == torch.float32
    assert float((got - block_gemv_ref(x, blocks, "MXFP4")).abs().max()) <= tol
    exact = (x.double() @ w.double().T).float()
    step = x.view(m, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(m, cols) / 65534
    assert bool(((got - exact).abs() <= step @ w.abs().T * 1.01 + tol).all())


def test_gpt_oss_experts_in_one_call_equal_their_reference(lib):
    """Pairs of 5 tokens over 6 MXFP4 experts (one with 3 tokens, one unused, a token twice):
    biases added, the clamped SwiGLU biting (limit 7 on gate sums of about 10), down's bias
    added, summed with the router weights; without biases and clamp it is SiLU-and-mul."""
    hidden, inter, num = 96, 64, 6
    rng = np.random.default_rng(5)
    gate, up, down = (torch.from_numpy(np.stack([random_blocks("MXFP4", r, c, rng) for _ in range(num)]))
                      for r, c in ((inter, hidden), (inter, hidden), (hidden, inter)))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, hidden, generator=gen)
    tokens = torch.tensor([0, 1, 2, 3, 4, 0, 2, 4])
    experts = torch.tensor([3, 3, 3, 0, 5, 1, 4, 1])
    weights = torch.rand(8, generator=gen)
    biases = ExpertBiases(torch.randn(num, 2 * inter, generator=gen), torch.randn(num, hidden, generator=gen))
    types = ("MXFP4",) * 3
    for b, act in ((biases, ClampedSwiGLU(1.702, 7.0)), (None, None)):
        want = moe_experts_ref(x, tokens, experts, weights, gate, up, down, types, biases=b, activation=act)
        scale = float(want.abs().max())
        for threads in (1, 2):
            got = moe_experts(lib, x, tokens, experts, weights, gate, up, down, types, threads=threads, biases=b,
                              activation=act)
            assert float((got - want).abs().max()) <= 1e-5 * scale, (b is None, threads)
    unclamped = moe_experts_ref(x, tokens, experts, weights, gate, up, down, types, biases=biases,
                                activation=ClampedSwiGLU(1.702, 1e9))
    clamped = moe_experts_ref(x, tokens, experts, weights, gate, up, down, types, biases=biases,
                              activation=ClampedSwiGLU(1.702, 7.0))
    assert float((unclamped - clamped).abs().max()) > 1e-2 * float(clamped.abs().max())  # the clamp bit
