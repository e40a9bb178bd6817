"""A/B of the CPU's AVX-512 block GEMM (``kernels/cpu/block_gemm.c``) against the path the
``cpu_block_gemm`` switch keeps (the AVX2 tile, and from 64 rows weights dequantized to
float32 for torch's GEMM), in one process, the two alternating, medians:

    python -m engine.bench.cpu_block_gemm --rows 1 16 128 512 --engine
    python -m engine.bench.cpu_block_gemm --rows --kquant-rows 1 4 16

The kernel alone at the default model's shapes (SmolLM2-135M: q/k/v, o, gate/up, down of
Q4_1 blocks, the tied head's Q8_0), through ``CpuBlockLinear`` as the engine calls it;
with ``--engine``, the default model's prefill and decode tokens/s (``engine_speed``) at
each ``--cases`` entry ``BATCHxPROMPTxNEW``; with ``--kquant-rows``, the K-quant tile
(``kernels/cpu/kquant_gemm.c``) against the AVX2 row product at a 30B-A3B's expert
shapes and two 8B projections, with GB/s of blocks read. A shared machine moves absolute figures;
the ratios of alternating runs are what to read.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kernels.quant.synthetic import random_blocks
from kernels.switches import using

# The default model's projections: (name, type, N, K).
SHAPES = (("qkv", "Q4_1", 960, 576), ("o", "Q4_1", 576, 576), ("gate_up", "Q4_1", 3072, 576),
          ("down", "Q4_1", 576, 1536), ("head", "Q8_0", 49152, 576))


def alternate(run: Callable[[], object], rounds: int, switch: str = "cpu_block_gemm",
              values: tuple = (False, True)) -> dict:
    """``run()``'s results with the kernel switch ``switch`` at each of its two ``values``
    (default: ``cpu_block_gemm`` off and on), ``rounds`` times each, the order flipped
    every round (so a drift of the machine falls on both): ``{value: [result, ...]}``."""
    got: dict = {v: [] for v in values}
    for r in range(rounds):
        for v in (values if r % 2 == 0 else values[::-1]):
            with using(**{switch: v}):
                got[v].append(run())
    return got


def _timed(f: Callable[[], object], reps: int) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t0) / reps
    return run


def kernel_rows(lib, rows: list[int], rounds: int) -> None:
    """Print microseconds a product, off and on, at each shape and row count."""
    from engine.layers.linear.cpu_blocks import CpuBlockLinear

    rng = np.random.default_rng(0)
    for name, type_name, n, k in SHAPES:
        linear = CpuBlockLinear(lib, k, [(type_name, torch.from_numpy(random_blocks(type_name, n, k, rng)))], None)
        for m in rows:
            x = torch.randn(m, k)
            linear(x)  # warm
            got = alternate(_timed(lambda linear=linear, x=x: linear(x), max(2, 2_000_000 // (n * m))), rounds)
            off, on = (statistics.median(got[s]) * 1e6 for s in (False, True))
            print(f"{name:8s} {type_name} {n:5d} x {k:4d}, {m:3d} rows: {off:9.1f} us -> {on:9.1f} us "
                  f"({off / on:.2f}x)", flush=True)


# K-quant projections: a 30B-A3B's experts (Qwen3-30B-A3B: hidden 2048, width 768; a
# Q4_K_M file's Q4_K gate/up and Q6_K or Q4_K down) and an 8B's attention and MLP.
KQUANT_SHAPES = (("expert gate/up", "Q4_K", 768, 2048), ("expert down", "Q6_K", 2048, 768),
                 ("expert down", "Q4_K", 2048, 768), ("proj", "Q4_K", 4096, 4096), ("mlp", "Q4_K", 14336, 4096))


def kquant_rows(lib, rows: list[int], rounds: int, experts: int) -> None:
    """Print microseconds and GB/s of blocks read, off (the AVX2 row product) and on
    (kquant_gemm.c's tile), at each K-quant shape and row count; the expert shapes as
    ``experts`` distinct matrices one after another, as a MoE step reads them."""
    from kernels.cpu.block_gemv import block_gemv

    rng = np.random.default_rng(0)
    for name, type_name, n, k in KQUANT_SHAPES:
        count = experts if name.startswith("expert") else 1
        mats = [torch.from_numpy(random_blocks(type_name, n, k, rng)) for _ in range(count)]
        nbytes = sum(w.numel() for w in mats)
        for m in rows:
            x = torch.randn(m, k)
            run = _timed(lambda x=x, t=type_name, mats=mats: [block_gemv(lib, x, w, t) for w in mats], max(2, 200_000_000 // (nbytes * m)))
            run()  # warm
            got = alternate(run, rounds)
            off, on = (statistics.median(got[s]) for s in (False, True))
            print(f"{name:15s} {count} x {type_name} {n:5d} x {k:4d}, {m:2d} rows: {off * 1e6:8.1f} us -> "
                  f"{on * 1e6:8.1f} us ({off / on:.2f}x); {nbytes / off / 1e9:5.1f} -> {nbytes / on / 1e9:5.1f} GB/s",
                  flush=True)


def engine_cases(cases: list[tuple[int, int, int]], rounds: int) -> None:
    """Print the default model's prefill and decode tokens/s, off and on, at each case."""
    from engine.bench.speed import engine_speed
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.loader.default_model import default_gguf_path
    from engine.worker.cpu_threads import fit_between_steps

    engine = Engine(EngineConfig(model=str(default_gguf_path()), device="cpu",
                                 max_running_requests=max(64, *(b for b, _, _ in cases))))
    between = fit_between_steps(engine.config.cpu_threads)
    g = torch.Generator().manual_seed(0)
    for batch, prompt, new in cases:
        prompts = [torch.randint(10, engine.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
        alternate(lambda prompts=prompts: engine_speed(engine, prompts, 4), 1)  # warm both
        got = alternate(lambda prompts=prompts, new=new: engine_speed(engine, prompts, new, between), rounds)
        print_engine_ab(batch, prompt, new, got[False], got[True])


def print_engine_ab(batch: int, prompt: int, new: int, before: list, after: list) -> None:
    """One engine case's A/B line: the medians of the prefill and decode tokens/s of the
    runs ``before`` and ``after`` a change (``engine_speed``'s results), and their ratios."""
    pre = [statistics.median(s.prefill_tok_s for s in runs) for runs in (before, after)]
    dec = [statistics.median(s.decode_tok_s for s in runs) for runs in (before, after)]
    print(f"{batch:2d} x {prompt} tokens, {new} new: prefill {pre[0]:7.1f} -> {pre[1]:7.1f} tok/s "
          f"({pre[1] / pre[0]:.2f}x); decode {dec[0]:6.1f} -> {dec[1]:6.1f} tok/s ({dec[1] / dec[0]:.2f}x)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16, 128, 512], help="activation rows")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each side, alternating")
    parser.add_argument("--engine", action="store_true", help="also the default model's tokens/s")
    parser.add_argument("--kquant-rows", type=int, nargs="*", default=[],
                        help="activation rows at the K-quant shapes (30B-A3B experts, 4096 x 4096, 14336 x 4096)")
    parser.add_argument("--experts", type=int, default=8, help="distinct experts a K-quant expert shape reads")
    parser.add_argument("--cases", default="1x128x64,16x128x32,1x512x16", help="BATCHxPROMPTxNEW, comma-separated")
    args = parser.parse_args()

    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build

    lib = cpu_kernels()
    if lib is None:
        raise SystemExit(f"the C CPU kernels do not build here: {build.why_not()}")
    if lib.hr_simd_level() < 2:
        raise SystemExit(f"this build is {build.simd_name(lib)}: no AVX-512 block GEMM to compare")
    print(f"{torch.get_num_threads()} threads; off: the AVX2 tile (float32 GEMM from 64 rows), on: the block GEMM")
    if args.rows:
        kernel_rows(lib, args.rows, args.rounds)
    if args.kquant_rows:
        kquant_rows(lib, args.kquant_rows, args.rounds, args.experts)
    if args.engine:
        engine_cases([tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")], args.rounds)


if __name__ == "__main__":
    main()
