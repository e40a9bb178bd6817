"""A mixture-of-experts GGUF larger than the card, experts in host memory: prefill and
decode tokens/s of the engine as the memory plan places it under ``--device-limit``.

    python -m engine.bench.offload_moe MODEL.gguf --device-limit 6GiB

The file is what ``python -m engine.bench.quant --shape qwen3-30b-a3b --write-gguf
PATH`` writes (or a real one). Each prompt length is run once untimed first (the
kernels' first-call compiles), then timed alone; each decode batch decodes a few steps
untimed, then ``--steps`` timed steps. Compare with llama.cpp's ``llama-bench -ngl 99
-ncmoe N -p 128,2048 -n 64`` and ``llama-batched-bench ... -npl 1,4`` on the same file,
the same GPU memory in use (the figure printed last, as NVML reads it).

``--cpu-share off,auto`` runs the whole benchmark once per value of the
``expert_cpu_share`` switch (a fresh engine each), so the decode step's time with the
CPU's share of the missing experts and without it print side by side; with the share on,
each decode batch also prints what the CPU's job took inside its steps (runs, pairs and
milliseconds a step, by the job's own timing), the measure of whether the cores or the
waits around them bound the step. The engine's log (the share's rates, each layer's
first split and the refits) goes to stderr.

``--trace PATH`` records the last decode batch's last 3 steps with torch's profiler
(CUDA kernels and copies on each stream, the host's ranges) as a Chrome trace
(``PATH``, one file per ``--cpu-share`` value: ``PATH`` with the value before the
suffix), to see whether the CPU's half runs beside the bus-read kernel or after it.

``--reserve 0`` plans without the desktop reserve: the comparison at the GPU memory in
use that llama.cpp, which keeps none, takes.

The other kernel switches come from their ``HEADROOM_*`` variables as serve reads them
(:func:`engine.common.environment.kernel_switches`): ``HEADROOM_EXPERT_STAGED_PREFILL=0``
times prefill with every chunk's missing experts read over the bus instead of staged.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import subprocess
import time
from pathlib import Path

import torch

from engine.common.config import EngineConfig
from engine.common.environment import kernel_switches
from engine.common.units import parse_size
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + 31 * j) % (vocab - 10) + 10 for j in range(n)]


def _run(engine: Engine, requests: list[GenerateRequest]) -> float:
    """Seconds to run ``requests`` to completion."""
    t0 = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a mixture-of-experts .gguf file")
    ap.add_argument("--device-limit", default="6GiB", help="plan as if the card were this big (default 6GiB)")
    ap.add_argument("--prefill", default="128,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (the graphs' gain, side by side)")
    ap.add_argument("--reserve", default=None,
                    help="the desktop reserve, a size such as 0 or 512MiB (default: the plan's automatic one)")
    ap.add_argument("--trace", default=None, help="write a Chrome trace of 3 decode steps of the last batch here")
    ap.add_argument("--cpu-share", default="off",
                    help="expert_cpu_share values to run in turn, comma-separated (off,auto: the share's gain per step)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    reserve = None if args.reserve is None else parse_size(args.reserve)
    try:
        switches = dataclasses.asdict(kernel_switches())
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("headroom").setLevel(logging.INFO)
    for share in args.cpu_share.split(","):
        engine = Engine(EngineConfig(model=args.model, device="cuda", device_limit=parse_size(args.device_limit),
                                     reserve=reserve, cuda_graphs=not args.no_cuda_graphs,
                                     **{**switches, "expert_cpu_share": share}))
        _bench(engine, args, share)
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def _bench(engine: Engine, args: argparse.Namespace, share: str) -> None:
    stores = engine.expert_stores
    print(f"plan (expert_cpu_share {share}): routed experts of {len(stores)} layers in host memory, "
          f"{sum(s.num_slots for s in stores)} cache slots; decode "
          f"{'in CUDA graphs' if engine.runner.graphs is not None else 'eager'}", flush=True)
    if engine.plan is not None:  # where the budget went, line by line (the measured plan)
        print(engine.plan.table(), flush=True)
    vocab = engine.vocab_size
    for n in (int(v) for v in args.prefill.split(",")):
        once = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        _run(engine, [GenerateRequest(request_id=f"warm-{n}", prompt_token_ids=_ids(n, n, vocab), sampling=once)])
        dt = _run(engine, [GenerateRequest(request_id=f"prefill-{n}", prompt_token_ids=_ids(n, n + 1, vocab),
                                           sampling=once)])
        print(f"prefill {n} tokens: {n / dt:.1f} tok/s ({dt:.2f} s)", flush=True)
    batches = [int(v) for v in args.batches.split(",")]
    for b in batches:
        long = SamplingParams(max_new_tokens=args.steps + 16, temperature=0.0, ignore_eos=True)
        for i in range(b):
            engine.add_request(GenerateRequest(request_id=f"decode-{b}-{i}", prompt_token_ids=_ids(32, 100 + i, vocab),
                                               sampling=long))
        for _ in range(8):  # the prefill and a few decode steps, untimed
            engine.step()
        torch.cuda.synchronize()
        before = _job_totals(stores)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        shared = sum(len(s.on_cpu) for s in stores)
        print(f"decode batch {b} (expert_cpu_share {share}, {shared} experts on the CPU): {b / dt:.1f} tok/s "
              f"({dt * 1e3:.1f} ms a step)", flush=True)
        runs, seconds, pairs = (a - z for a, z in zip(_job_totals(stores), before, strict=True))
        if runs:
            print(f"  the CPU's job: {runs / args.steps:.1f} runs, {pairs / args.steps:.1f} pairs and "
                  f"{seconds / args.steps * 1e3:.2f} ms a step inside them ({seconds / runs * 1e6:.0f} us a run)",
                  flush=True)
        if args.trace and b == batches[-1]:
            _trace(engine, _trace_path(args.trace, share))
        for i in range(b):
            engine.abort(f"decode-{b}-{i}")
        engine.step()
    print(f"expert counters: {engine.expert_counters}")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False)
    print(f"GPU memory in use (NVML): {smi.stdout.strip() or 'nvidia-smi not found'}")


def _trace_path(path: str, share: str) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}-{share}{p.suffix or '.json'}")


def _trace(engine: Engine, path: Path, steps: int = 3) -> None:
    """``steps`` decode steps under torch's profiler, written to ``path`` (Chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    print(f"  trace of {steps} decode steps: {path}", flush=True)


def _job_totals(stores: list) -> tuple[int, float, int]:
    """The CPU share's jobs over every host layer: ``(runs, seconds, pairs)`` so far."""
    totals = [s.share_job_totals() for s in stores]
    return sum(t[0] for t in totals), sum(t[1] for t in totals), sum(t[2] for t in totals)


if __name__ == "__main__":
    main()
