"""The quantized GEMV and GEMM alone, on CUDA: each kernel on a model's projection shapes,
a sweep of the GEMV's tilings, the prefill GEMM; timed in CUDA graphs over rotating
copies of the weight (so the L2 cache holds none of it), with the share of the HBM
roofline against the measured device copy bandwidth (:func:`copy_bandwidth`). Rows for
:mod:`engine.bench.quant`'s tables."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.common.units import GiB
from kernels.switches import using

GRAPH_REPLAYS = 50


def copy_bandwidth(nbytes: int = GiB) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1000)


def graph_seconds(fn, replays: int = GRAPH_REPLAYS) -> float:
    """Seconds one call of ``fn`` takes, replayed in a CUDA graph."""
    from engine.bench.kernels import _graph_us

    return _graph_us(fn, replays * 20) / 1e6


def _rotating(w: torch.Tensor, reach: int = 512 << 20) -> list[torch.Tensor]:
    """Copies of ``w`` adding up to ``reach`` bytes (at least 2), so that back-to-back
    calls cycling through them read HBM rather than the 50 MB L2."""
    return [w] + [w.clone() for _ in range(max(1, -(-reach // w.nbytes) - 1))]


def _gemv_seconds(x: torch.Tensor, w: torch.Tensor, kind: str, replays: int = GRAPH_REPLAYS, **tiling) -> float:
    from kernels.quant.triton_kernel import quant_gemv

    copies = _rotating(w)
    turn = itertools.cycle(copies)
    return graph_seconds(lambda: quant_gemv(x, next(turn), kind, **tiling), replays)


def _int8_seconds(x: torch.Tensor, w: torch.Tensor, kind: str, variant: dict, replays: int = 5, **tiling) -> float:
    """As :func:`_gemv_seconds` for the int8 GEMV at a forced tiling and variant, the
    activations' quantization included (inside the GEMV, or in a launch of its own
    first unless the ``quant_int8_fuse`` switch is on)."""
    from kernels.quant.int8_choice import int8_quantize_apart
    from kernels.quant.triton_activations import quantize_activations
    from kernels.quant.triton_int8 import int8_gemv

    turn = itertools.cycle(_rotating(w))
    if int8_quantize_apart():
        return graph_seconds(lambda: int8_gemv(quantize_activations(x), next(turn), kind, variant=variant, **tiling),
                              replays)
    return graph_seconds(lambda: int8_gemv(x, next(turn), kind, variant=variant, **tiling), replays)


def gemv_rows(model, bandwidth: float, m: int = 1) -> list[str]:
    """The dequantize-GEMV alone at ``m`` rows on each distinct projection of the model
    (weights rotated through copies so each call reads HBM)."""
    from engine.layers.linear.gguf_blocks import QuantLinear

    seen = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            for spec, w in mod.part_views():
                if spec.type_name is not None:
                    seen.setdefault((spec.type_name, tuple(w.shape), mod.in_features), (name, w))
    rows = []
    for (kind, _, k), (name, w) in sorted(seen.items(), key=lambda kv: kv[1][0]):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        seconds = _gemv_seconds(x, w, kind)
        rows.append(f"| {name.split('.', 3)[-1]} | {kind} | {w.shape[0]}x{k} | {m} | {seconds * 1e6:.1f} | "
                    f"{w.nbytes / seconds / bandwidth:.0%} |")
    return rows


def sweep_rows(bandwidth: float, shapes: list[tuple[str, int, int]]) -> list[str]:
    """The GEMV at one row per projection shape: what the autotuner picked, then its
    tilings (for the int8 GEMV all of them, else the best three and the worst two),
    then the best without the PTX code conversion (the float GEMV) or, for the int8
    GEMV's types, the float GEMV's own tuned pick."""
    import triton

    from kernels.quant import triton_int8
    from kernels.quant import triton_kernel as triton_quant
    from kernels.quant.formats import block_format
    from kernels.quant.int8_choice import int8_quantize_apart, uses_int8_dot
    from kernels.quant.synthetic import random_blocks

    rows = []
    rng = np.random.default_rng(0)
    for kind, n, k in shapes:
        w = torch.from_numpy(random_blocks(kind, n, k, rng, scale=1e-4)).cuda()
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        int8 = uses_int8_dot(kind)
        results = []
        if int8:
            configs = triton_int8._prune(triton_int8._configs(), {"QT": block_format(kind).code,
                                                                  "QUANT_X": not int8_quantize_apart()})
        else:
            configs = triton_quant._prune(triton_quant._gemv_configs(),
                                          {"QK": block_format(kind).block_elements})
        for c in configs:
            tiling = dict(block_n=c.kwargs["BLOCK_N"], blocks_per_step=c.kwargs["KB"], num_warps=c.num_warps, split_k=1)
            split = c.kwargs.get("SPLIT", 0)
            prefetch = c.kwargs.get("PREFETCH", 0)
            try:
                if int8:
                    seconds = _int8_seconds(x, w, kind, {"SPLIT": split, "PREFETCH": prefetch}, **tiling)
                else:
                    seconds = _gemv_seconds(x, w, kind, replays=5, **tiling)
            except (RuntimeError, triton.runtime.errors.OutOfResources) as e:
                print(f"{kind} {n}x{k} {c}: {str(e).splitlines()[0]}")
                continue
            results.append((seconds, f"block_n {c.kwargs['BLOCK_N']}, kb {c.kwargs['KB']}, warps {c.num_warps}"
                            + (f", split {split}, prefetch {prefetch}" if int8 else ", ptx True")))
        results.sort()
        if int8:
            # The best tiling with K split over 2-4 programs a tile (atomics into a
            # zeroed float32 row, then a copy: both launches timed too).
            best = results[0][1]
            tiling = dict(item.split(" ") for item in best.split(", "))
            for split_k in (2, 4):
                seconds = _int8_seconds(x, w, kind, {"SPLIT": int(tiling["split"]), "PREFETCH": int(tiling["prefetch"])},
                                        block_n=int(tiling["block_n"]), blocks_per_step=int(tiling["kb"]),
                                        num_warps=int(tiling["warps"]), split_k=split_k)
                results.append((seconds, f"{best}, split-K {split_k}"))
            other = _gemv_seconds(x, w, kind, replays=5, int8_dot=False)
            results.append((other, "float GEMV, tuned"))
        else:
            label = results[0][1]
            tiling = dict(item.split(" ") for item in label.split(", ")[:3])
            with using(quant_ptx=False):
                other = _gemv_seconds(x, w, kind, replays=5, block_n=int(tiling["block_n"]),
                                      blocks_per_step=int(tiling["kb"]), num_warps=int(tiling["warps"]), split_k=1)
            results.append((other, label.replace("ptx True", "ptx False")))
        default = _gemv_seconds(x, w, kind, replays=5)
        tuned = triton_int8._tuned if int8 else triton_quant._gemv_tuned
        picked = [str(c) for key, c in tuned.cache.items() if n in key and k in key]
        shape_rows = [f"| {kind} {n}x{k} | {'int8 ' if int8 else ''}tuned ({'; '.join(picked)}) | {default * 1e6:.1f} | "
                      f"{w.nbytes / default / bandwidth:.0%} |"]
        for seconds, label in results if int8 else results[:3] + results[-2:]:
            shape_rows.append(f"| {kind} {n}x{k} | {label} | {seconds * 1e6:.1f} | {w.nbytes / seconds / bandwidth:.0%} |")
        print("\n".join(shape_rows), flush=True)
        rows += shape_rows
        del w
    return rows


def gemm_rows(bandwidth: float, shapes: list[tuple[str, int, int]], m: int = 512) -> list[str]:
    """The prefill GEMM at ``m`` rows per projection shape (weights rotated through
    copies), in TFLOP/s and as a share of the roofline of reading the weights once."""
    from kernels.quant.synthetic import random_blocks
    from kernels.quant.triton_kernel import quant_gemm

    rows = []
    rng = np.random.default_rng(1)
    for kind, n, k in shapes:
        w = torch.from_numpy(random_blocks(kind, n, k, rng, scale=1e-4)).cuda()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        turn = itertools.cycle(_rotating(w))
        seconds = graph_seconds(lambda x=x, turn=turn, kind=kind: quant_gemm(x, next(turn), kind), 5)
        rows.append(f"| {kind} {n}x{k} | {m} | {seconds * 1e6:.1f} | {2 * m * n * k / seconds / 1e12:.1f} | "
                    f"{w.nbytes / seconds / bandwidth:.0%} |")
        print(rows[-1], flush=True)
        del w
    return rows


def _gemm_variants(x: torch.Tensor, turn, dense_turn, kind: str) -> list[tuple[float, str]]:
    """(seconds, label) of ``x`` times the rotated block weights at each GEMM tiling,
    dequantized whole then cuBLAS, and times the rotated bfloat16 weights."""
    from kernels.quant.gemm_tuning import GEMM_TILINGS, INT8_TILINGS, PACKED_TILINGS
    from kernels.quant.triton_dequant import dequant_matmul
    from kernels.quant.triton_kernel import quant_gemm
    from kernels.quant.triton_packed_gemm import PACKED_TYPES

    tilings = GEMM_TILINGS + INT8_TILINGS + (PACKED_TILINGS if kind in PACKED_TYPES else ())
    timed = [(graph_seconds(lambda t=t: quant_gemm(x, next(turn), kind, tiling=t), 5),
              f"{'int8' if t.int8 else 'packed' if t.packed else 'tile'} GEMM {t.block_n}x{t.k_step} "
              f"w{t.num_warps} s{t.num_stages}")
             for t in tilings]
    timed.append((graph_seconds(lambda: dequant_matmul(x, next(turn), kind), 5), "dequantize + cuBLAS"))
    timed.append((graph_seconds(lambda: x @ next(dense_turn).T, 5), "bfloat16 weight, cuBLAS"))
    return timed


def gemm_sweep_rows(bandwidth: float, shapes: list[tuple[str, int, int]], ms: tuple[int, ...] = (16, 64, 128)) -> list[str]:
    """The block GEMM at each of :data:`kernels.quant.gemm_tuning.GEMM_TILINGS` (the
    int8 GEMM at each of its ``INT8_TILINGS``, the packed GEMM at its ``PACKED_TILINGS``
    for its types) per projection shape and row count, beside the same product with the weight dequantized
    whole first (:func:`kernels.quant.triton_dequant.dequant_matmul`) and a bfloat16
    weight's cuBLAS GEMM (weights rotated through copies): us per product and the
    roofline share of reading the blocks once."""
    from kernels.quant.synthetic import random_blocks

    rows = []
    rng = np.random.default_rng(2)
    for kind, n, k in shapes:
        w = torch.from_numpy(random_blocks(kind, n, k, rng, scale=1e-4)).cuda()
        turn = itertools.cycle(_rotating(w))
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dense_turn = itertools.cycle(_rotating(dense))
        for m in ms:
            timed = _gemm_variants(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), turn, dense_turn, kind)
            for seconds, label in timed:
                rows.append(f"| {kind} {n}x{k} | {m} | {label} | {seconds * 1e6:.1f} | {w.nbytes / seconds / bandwidth:.0%} |")
            print("\n".join(rows[-len(timed):]), flush=True)
        del w, dense
        torch.cuda.empty_cache()
    return rows
