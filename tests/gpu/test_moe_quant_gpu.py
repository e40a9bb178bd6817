"""Routed experts kept in GGUF blocks on CUDA: the Triton fused MoE over blocks against
the torch reference at Qwen3-30B-A3B's expert shape, a tiny Qwen3-MoE GGUF served in
blocks against the same file dequantized, and (``pytest -s``) per-layer decode times and
the experts' VRAM against bfloat16 experts.

Tolerances: bfloat16 activations, the reference's weights dequantized and rounded to
bfloat16 (the kernels multiply by the unrounded weights), two matmuls and a SiLU each
rounded to bfloat16: within 2**-5 of the largest output, and 1 % in relative
Frobenius norm. The model check runs float32 on both sides (summation order only).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.common.units import GiB, MiB
from kernels.moe.reference import fused_moe as torch_fused_moe
from kernels.moe.reference import route
from kernels.quant.reference import dequantize
from kernels.quant.synthetic import random_blocks

# Qwen3-30B-A3B's routed experts (Qwen/Qwen3-30B-A3B config.json).
HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8
Q4_K_M = ("Q4_K", "Q4_K", "Q6_K")


def _blocks(types, rng, scale=1e-3):
    """Stacked random gate, up, down blocks of the Qwen3-30B-A3B shape on CUDA."""
    shapes = ((MOE_INTERMEDIATE, HIDDEN), (MOE_INTERMEDIATE, HIDDEN), (HIDDEN, MOE_INTERMEDIATE))
    return tuple(torch.from_numpy(np.stack([random_blocks(t, r, c, rng, scale=scale) for _ in range(EXPERTS)])).cuda()
                 for t, (r, c) in zip(types, shapes, strict=True))


def _dense(blocks, types, dtype=torch.bfloat16):
    """The same experts dequantized: ``[E, 2I, H]`` and ``[E, H, I]`` in ``dtype``."""
    gate, up, down = (dequantize(b.reshape(-1, b.shape[-1]), t, k).reshape(EXPERTS, -1, k).to(dtype)
                      for b, t, k in zip(blocks, types, (HIDDEN, HIDDEN, MOE_INTERMEDIATE), strict=True))
    return torch.cat([gate, up], dim=1), down


def _routing(tokens, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(dtype)
    weights, ids = route(torch.randn(tokens, EXPERTS, device="cuda", generator=g), TOP_K, renormalize=True)
    return x, weights.to(dtype), ids


@pytest.mark.parametrize("types", [Q4_K_M, ("Q4_K",) * 3, ("Q6_K",) * 3, ("Q8_0",) * 3], ids="-".join)
def test_fused_moe_over_blocks_matches_the_reference_at_qwen3_30b_a3b_shape(types):
    from kernels.moe.quant_triton_kernel import fused_moe_quant

    blocks = _blocks(types, np.random.default_rng(0))
    w_gate_up, w_down = _dense(blocks, types)
    for tokens in (1, 16, 300):
        x, weights, ids = _routing(tokens, seed=tokens)
        ref = torch_fused_moe(x, w_gate_up, w_down, weights, ids).float()  # the torch loop over experts
        methods = ("gemv", "gemm") if tokens == 16 else (None,)
        for method in methods:
            out = fused_moe_quant(x, *blocks, types, weights, ids, method=method).float()
            scale = float(ref.abs().max())
            diff = float((out - ref).abs().max())
            assert diff <= 2**-5 * scale, (types, tokens, method, diff, scale)
            assert float((out - ref).norm() / ref.norm()) <= 1e-2, (types, tokens, method)


def test_tiny_qwen3_moe_gguf_in_blocks_gives_the_dequantized_greedy_ids(tmp_path, make_tiny_hf_model, paged_runner):
    """float32 on CUDA: the experts' blocks through the Triton kernels against the
    experts dequantized at load through the dense Triton MoE; 16 greedy steps."""
    from test_gguf_moe_quant import STEPS, write_tiny_moe_gguf

    from engine.layers.moe.quant_experts import QuantExperts
    from engine.loader.gguf_quant import load_gguf_quantized

    path, config = write_tiny_moe_gguf(tmp_path, make_tiny_hf_model)
    blocks = load_gguf_quantized(config, path, "cuda", torch.float32)
    assert isinstance(blocks.model.layers[0].mlp.experts, QuantExperts)
    dense = load_gguf_quantized(config, path, "cuda", torch.float32, experts_in_blocks=False)
    a, b = paged_runner(dense, config, device="cuda"), paged_runner(blocks, config, device="cuda")
    ids = [5, 70, 3, 200, 42, 42, 9, 100] * 5  # 40 tokens: the prefill GEMM
    la, lb = a.step({0: ids})[0], b.step({0: ids})[0]
    greedy_a, greedy_b = [], []
    for _ in range(STEPS):
        assert float((la - lb).abs().max()) <= 1e-4 * max(1.0, float(la.abs().max()))
        greedy_a.append(int(la.argmax()))
        greedy_b.append(int(lb.argmax()))
        la, lb = a.step({0: [greedy_a[-1]]})[0], b.step({0: [greedy_b[-1]]})[0]
    assert greedy_a == greedy_b


def _layer_us(fn, weight_sets, reps=200) -> float:
    """Microseconds per call of ``fn(*weights)``, cycling through ``weight_sets`` (copies
    adding up past the 50 MB L2, so each call reads HBM), CUDA-event timed."""
    turn = itertools.cycle(weight_sets)
    for _ in range(10):
        fn(*next(turn))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*next(turn))
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def test_decode_time_and_vram_of_a_qwen3_30b_a3b_layer():
    """Printed (``pytest -s``): one layer's routed experts at batch 1 and 16, Q4_K gate/up
    and Q6_K down in blocks against bfloat16 experts through the dense fused MoE; and the
    experts' bytes both ways."""
    from kernels.moe.quant_triton_kernel import fused_moe_quant
    from kernels.moe.triton_kernel import fused_moe

    blocks = _blocks(Q4_K_M, np.random.default_rng(0), scale=1e-4)
    w_gate_up, w_down = _dense(blocks, Q4_K_M)
    quant_bytes = sum(b.nbytes for b in blocks)
    dense_bytes = w_gate_up.nbytes + w_down.nbytes
    quant_sets = [blocks] + [tuple(b.clone() for b in blocks) for _ in range(max(1, (1 << 30) // quant_bytes))]
    dense_sets = [(w_gate_up, w_down), (w_gate_up.clone(), w_down.clone())]
    print(f"\nQwen3-30B-A3B layer experts: {Q4_K_M} blocks {quant_bytes / MiB:.1f} MiB, bfloat16 "
          f"{dense_bytes / MiB:.1f} MiB ({dense_bytes / quant_bytes:.2f}x); 48 layers: {48 * quant_bytes / GiB:.2f} "
          f"vs {48 * dense_bytes / GiB:.2f} GiB")
    print("| batch | experts | method | us/layer | GB/s of expert bytes touched |")
    for tokens in (1, 16):
        x, weights, ids = _routing(tokens)
        touched = int(torch.unique(ids).numel())
        for method in ("gemv", "gemm"):
            us = _layer_us(lambda g, u, d, m=method, x=x, w=weights, i=ids: fused_moe_quant(x, g, u, d, Q4_K_M, w, i,
                                                                                            method=m), quant_sets)
            rate = touched * quant_bytes / EXPERTS / (us * 1e-6) / 1e9
            print(f"| {tokens} | {Q4_K_M[0]}/{Q4_K_M[2]} blocks | {method} | {us:.1f} | {rate:.0f} |")
        us = _layer_us(lambda gu, dn, x=x, w=weights, i=ids: fused_moe(x, gu, dn, w, i), dense_sets)
        rate = touched * dense_bytes / EXPERTS / (us * 1e-6) / 1e9
        print(f"| {tokens} | bfloat16 | grouped GEMM | {us:.1f} | {rate:.0f} |")
    assert quant_bytes < 0.4 * dense_bytes
