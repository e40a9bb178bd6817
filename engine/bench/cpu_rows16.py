"""A/B of the CPU's blocks interleaved by 16 rows (``kernels/cpu/rows16.c``, the
``cpu_rows16`` switch) against the GGUF layout on the block GEMM, in one process, the two
alternating, medians:

    python -m engine.bench.cpu_rows16 --rows 1 4 16 128 --engine

The kernel alone: a decode step's 30 layers of the default model's projections (q/k/v,
o, gate/up, down of Q4_1 blocks, each layer its own copy, 66 MB, so they stream from
memory as in a step), called straight through the library (no Python between calls),
milliseconds and GB/s; with ``--engine``, two engines of the default model (the switch
is read at load) and their prefill and decode tokens/s at each ``--cases`` entry
``BATCHxPROMPTxNEW``. A shared machine moves absolute figures; the ratios of alternating
runs are what to read.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kernels.quant.synthetic import random_blocks

# One layer of the default model (SmolLM2-135M): (N, K) of q/k/v, o, gate/up, down.
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _alternate(runs: dict[str, object], rounds: int) -> dict[str, list[float]]:
    """Each of ``runs`` (name -> callable returning a figure) ``rounds`` times, the order
    flipped every round."""
    got: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            got[name].append(runs[name]())
    return got


def kernel_rows(lib, rows: list[int], rounds: int, layers: int = 30) -> None:
    """Print a step's projections (``layers`` layers, Q4_1) in ms, GGUF layout and
    interleaved, at each activation row count."""
    from kernels.cpu import rows16
    from kernels.cpu.block_gemv import ROWS16_IDS, TYPE_IDS

    rng = np.random.default_rng(0)
    first = [torch.from_numpy(random_blocks("Q4_1", n, k, rng)) for n, k in LAYER]
    gguf = [[w.clone() for w in first] for _ in range(layers)]
    inter = [[rows16.interleave(w, "Q4_1") for w in layer] for layer in gguf]
    nbytes = sum(w.numel() for layer in gguf for w in layer)
    threads = torch.get_num_threads()
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        work = torch.empty(lib.hr_work_bytes(m, 1536), dtype=torch.uint8)
        y = torch.empty(m * max(n for n, _ in LAYER))

        def step(sets, type_id, xs=xs, work=work, y=y, m=m):
            t0 = time.perf_counter()
            for layer in sets:
                for (n, k), w in zip(LAYER, layer, strict=True):
                    lib.hr_block_gemv(type_id, xs[k].data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(), n,
                                      work.data_ptr(), threads, 0)
            return time.perf_counter() - t0

        runs = {"gguf": lambda: step(gguf, TYPE_IDS["Q4_1"]), "rows16": lambda: step(inter, ROWS16_IDS["Q4_1x16"])}
        got = _alternate(runs, rounds)
        a, b = statistics.median(got["gguf"]), statistics.median(got["rows16"])
        print(f"{layers} layers' projections, {m:3d} rows, {threads} threads: {a * 1e3:7.2f} ms -> {b * 1e3:7.2f} ms "
              f"({a / b:.2f}x); {nbytes / a / 1e9:5.1f} -> {nbytes / b / 1e9:5.1f} GB/s", flush=True)


def engine_cases(cases: list[tuple[int, int, int]], rounds: int, threads: str) -> None:
    """Print the default model's prefill and decode tokens/s, GGUF layout and
    interleaved (two engines), at each case."""
    from engine.bench.cpu_block_gemm import print_engine_ab
    from engine.bench.speed import engine_speed
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.loader.default_model import default_gguf_path
    from engine.worker.cpu_threads import fit_between_steps

    engines = {name: Engine(EngineConfig(model=str(default_gguf_path()), device="cpu", cpu_rows16=on,
                                         max_running_requests=max(64, *(b for b, _, _ in cases))))
               for name, on in (("gguf", False), ("rows16", True))}
    between = fit_between_steps(threads)
    g = torch.Generator().manual_seed(0)
    for batch, prompt, new in cases:
        prompts = [torch.randint(10, engines["gguf"].vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
        for e in engines.values():
            engine_speed(e, prompts, 4)  # warm
        got = _alternate({name: (lambda e=e, prompts=prompts, new=new: engine_speed(e, prompts, new, between))
                          for name, e in engines.items()}, rounds)
        before, after = (got[n] for n in engines)
        print_engine_ab(batch, prompt, new, before, after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 128], help="activation rows")
    parser.add_argument("--rounds", type=int, default=7, help="runs of each side, alternating")
    parser.add_argument("--engine", action="store_true", help="also the default model's tokens/s")
    parser.add_argument("--cases", default="1x128x64,16x128x32", help="BATCHxPROMPTxNEW, comma-separated")
    parser.add_argument("--cpu-threads", default="auto", help="threads of the engine runs (as --cpu-threads)")
    args = parser.parse_args()

    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build, rows16

    lib = cpu_kernels()
    if lib is None:
        raise SystemExit(f"the C CPU kernels do not build here: {build.why_not()}")
    if not rows16.available(lib):
        raise SystemExit(f"this build is {build.simd_name(lib)}: no interleaved blocks (they need AVX-512 BW)")
    if args.rows:
        kernel_rows(lib, args.rows, args.rounds)
    if args.engine:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
        engine_cases(cases, args.rounds, args.cpu_threads)


if __name__ == "__main__":
    main()
