"""The block GEMM's tilings on the GPU: every tiling the tuner may pick, float and int8,
gives the product at real shapes; the tuner times a shape once, keeps the fastest, and
inside a CUDA graph capture runs the default without timing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_int8_kernels import INT8_ROUNDING_TOL

from kernels.quant import gemm_tuning, reference
from kernels.quant.synthetic import random_blocks
from kernels.quant.triton_activations import quantize_activations


@pytest.mark.parametrize("type_name,n,k", [("Q4_K", 4096, 4096), ("Q6_K_P", 4096, 14336), ("Q8_0", 576, 1536)])
@pytest.mark.parametrize("m", [16, 40, 64])
def test_every_tiling_gives_the_product(type_name, n, k, m):
    from kernels.quant.triton_kernel import quant_gemm

    rng = np.random.default_rng(n + m)
    w = torch.from_numpy(random_blocks(type_name, n, k, rng, scale=1e-3)).cuda()
    weight = reference.dequantize(w, type_name, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    exact = x.float() @ weight.T
    q8 = quantize_activations(x)
    rounded = (q8.codes.float().view(m, -1, 32) * q8.scales[:, :, None]).view(m, k) @ weight.T
    for tiling in gemm_tuning.GEMM_TILINGS + gemm_tuning.INT8_TILINGS:
        out = quant_gemm(x, w, type_name, tiling=tiling).float()
        want, tol = (rounded, 2**-6) if tiling.int8 else (exact, 2**-6)
        assert float((out - want).abs().max()) <= tol * float(want.abs().max()), tiling
        assert float((out - exact).abs().max()) <= INT8_ROUNDING_TOL * float(exact.abs().max()), tiling


def test_the_tuner_times_a_shape_once_and_never_inside_a_capture(monkeypatch):
    from kernels.quant.triton_kernel import quant_gemm

    w = torch.from_numpy(random_blocks("Q4_K", 1024, 2048, np.random.default_rng(0), scale=1e-3)).cuda()
    x = torch.randn(24, 2048, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(gemm_tuning, "_best", {})
    timed = []
    tuned = gemm_tuning.tuned

    families = []

    def counting(block_m, n, k, type_name, device, run, family="float"):
        def counted(tiling):
            timed.append(tiling)
            return run(tiling)
        families.append(family)
        return tuned(block_m, n, k, type_name, device, counted, family)

    monkeypatch.setattr("kernels.quant.triton_kernel.tuned", counting)
    first = quant_gemm(x, w, "Q4_K")
    runs = len(timed)
    # bfloat16 rows of Q4_K take the packed GEMM's tilings on sm_90, the float ones elsewhere.
    candidates = gemm_tuning.FAMILIES[families[0]]
    assert runs == len(candidates) * (1 + gemm_tuning._TIMED_RUNS)
    (best,) = gemm_tuning._best.values()
    assert best in candidates
    torch.testing.assert_close(quant_gemm(x, w, "Q4_K"), first)  # split-K adds in any order
    assert len(timed) == runs  # kept, not timed again
    # A new shape first met inside a capture: the default, nothing timed.
    x2 = torch.randn(40, 2048, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = quant_gemm(x2, w, "Q4_K")
    graph.replay()
    torch.cuda.synchronize()
    assert len(timed) == runs and len(gemm_tuning._best) == 1
    eager = quant_gemm(x2, w, "Q4_K", tiling=candidates[0])
    torch.testing.assert_close(captured, eager)
