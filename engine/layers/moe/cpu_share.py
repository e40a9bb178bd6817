"""A host layer's missing experts split between the bus and the CPU's cores (the
``expert_cpu_share`` switch): the policy and the rates it splits by.

On CUDA a decode step of a layer whose experts live in pinned host memory reads every
missing expert over the bus inside the fused kernel (:mod:`engine.layers.moe.bus_reads`).
With the share on, the layer's uncached experts are split in two, once between steps:
the **bus** ones stay so, the **CPU** ones get :data:`~kernels.cpu.moe_job.CPU_RUN` in
the layer's device lut, which the fused kernel skips and the C job
(:mod:`kernels.cpu.moe_job`, queued beside it: :mod:`engine.layers.moe.share_step`) runs
on the cores, so that both halves take about as long. A step then costs about
``bus * cpu / (bus + cpu)`` of what the bus alone took (a Qwen3-30B-A3B-shape layer's 8
routed experts: 560 us over the bus, 440 us on 16 cores, about 250 us shared).

:func:`split_share` balances the expected time of the two halves: each uncached expert's
chance of being routed in a step (its heat, mixed with a uniform prior so that an expert
never seen still counts, scaled to ``top_k`` routed experts a step) times its cost on each
side (:class:`ShareRates`), greedily, the likeliest first, each to the side that ends
sooner; the CPU's side starts at its fixed cost (the copies and the host function), paid
every step the share is on. The split is recomputed when the heat or the cached set
changes (a refresh, a resize), between steps, never inside a capture.

The rates are measured at start, with the job alone on the machine; inside the decode
steps it shares the cores with the worker's own thread and runs from the CUDA runtime's
callback thread, and on an H200 host it took longer there than measured, so that every
layer waited for it. :func:`refit_cpu_rate` refits the CPU's rates (a call's fixed part
and an expert's) at each refresh from what the job itself timed inside the steps since
the last one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.layers.moe.expert_costs import best_time
from engine.layers.moe.expert_stacks import BlockStack

if TYPE_CHECKING:
    from kernels.cpu.moe_job import JobWindow

# Share of the uniform prior in an expert's weight: an expert never routed yet still
# counts for a tenth of an even routing.
UNIFORM_PRIOR = 0.1
# Distinct experts the CPU's timing routes one token to (a decode step's top-k).
TIMED_EXPERTS = 8
# Weight of a refit's measurement against the rate it replaces (an average over the
# refreshes, each older one weighing half the next).
REFIT_WEIGHT = 0.5
# Fewest CPU pairs run since the last refit for a refit of the rate.
REFIT_MIN_PAIRS = 16


@dataclass(frozen=True)
class ShareRates:
    """Seconds a decode step spends on one routed missing expert, each way: ``bus_s``
    (its blocks read over the bus by the fused kernel), ``cpu_s`` (one more expert in the
    CPU job) and ``cpu_fixed_s`` (the CPU job's cost with no expert: copies, host
    function, the threads' wake-up), of which ``job_fixed_s`` is the C job's own (the part
    its timing of itself includes: :func:`refit_cpu_rate`)."""

    bus_s: float
    cpu_s: float
    cpu_fixed_s: float
    job_fixed_s: float = 0.0

    def balanced_s(self, experts: float) -> float:
        """A step's time over ``experts`` missing experts split evenly by time, the CPU's
        fixed cost aside: ``experts * bus * cpu / (bus + cpu)``."""
        return experts * self.bus_s * self.cpu_s / (self.bus_s + self.cpu_s)


@dataclass(frozen=True)
class Split:
    """A layer's uncached experts split: ``cpu`` (sorted) run on the cores; the expected
    seconds a step of each half takes (``cpu_s`` with the fixed cost)."""

    cpu: tuple[int, ...]
    cpu_s: float
    bus_s: float


def split_share(heat: torch.Tensor, cached: set[int] | dict[int, int], top_k: int, rates: ShareRates) -> Split:
    """The split of the experts not in ``cached`` (module docstring).

    Args:
        heat: float ``[E]``, each expert's recent routings a step (any scale; zeros: an
            even routing).
        cached: the experts in the cache (read from their slots; in neither half).
        top_k: routed experts per token.
        rates: the seconds each side takes for one expert.

    Raises:
        ValueError: ``top_k`` below 1, or negative rates.
    """
    if top_k < 1 or min(rates.bus_s, rates.cpu_s, rates.cpu_fixed_s) < 0:
        raise ValueError(f"a share needs top_k >= 1 and rates >= 0, got top_k {top_k} and {rates}")
    heat = heat.double().clamp(min=0)
    num = heat.numel()
    share = heat / heat.sum() if float(heat.sum()) > 0 else torch.full((num,), 1.0 / num, dtype=torch.float64)
    chance = top_k * ((1 - UNIFORM_PRIOR) * share + UNIFORM_PRIOR / num)
    uncached = sorted((e for e in range(num) if e not in cached), key=lambda e: (-float(chance[e]), e))
    cpu_t, bus_t, cpu = rates.cpu_fixed_s, 0.0, []
    for e in uncached:
        p = float(chance[e])
        if cpu_t + p * rates.cpu_s <= bus_t + p * rates.bus_s:
            cpu_t += p * rates.cpu_s
            cpu.append(e)
        else:
            bus_t += p * rates.bus_s
    return Split(tuple(sorted(cpu)), cpu_t, bus_t)


def refit_cpu_rate(rates: ShareRates, window: JobWindow) -> ShareRates:
    """``rates`` refit to what the C job took inside the decode steps since the last refit
    (``window``: its calls, their wall time by the job's own timing, the CPU pairs run).

    Where the calls that ran pairs ran different numbers of them, a least-squares line of
    a call's seconds against its pairs (:meth:`~kernels.cpu.moe_job.JobWindow.line`) gives
    both the job's fixed part a call (``job_fixed_s``; ``cpu_fixed_s`` moves with it) and
    ``cpu_s``: inside the steps each call first wakes its threads, which the start's
    back-to-back timing never paid, and charged to the pairs of a one-row step (two or
    three a call) that cost made the cores look slower than the bus and the split gave
    them nothing. Otherwise the seconds a pair with the old fixed part a call aside.
    Each is averaged in with weight :data:`REFIT_WEIGHT`. The same object when fewer
    than :data:`REFIT_MIN_PAIRS` pairs ran (a split that gives the CPU nothing keeps its
    rates).

    Raises:
        ValueError: negative runs, seconds or pairs.
    """
    runs, seconds, pairs = window.runs, window.seconds, window.pairs
    if min(runs, seconds, pairs) < 0:
        raise ValueError(f"a refit takes counts and seconds >= 0, got {runs} runs, {seconds} s, {pairs} pairs")
    if pairs < REFIT_MIN_PAIRS:
        return rates
    line = window.line()
    if line is None or line[1] <= 0:
        measured = max(seconds - runs * rates.job_fixed_s, 0.0) / pairs
        return replace(rates, cpu_s=(1 - REFIT_WEIGHT) * rates.cpu_s + REFIT_WEIGHT * measured)
    fixed = (1 - REFIT_WEIGHT) * rates.job_fixed_s + REFIT_WEIGHT * max(line[0], 0.0)
    return replace(rates, cpu_s=(1 - REFIT_WEIGHT) * rates.cpu_s + REFIT_WEIGHT * line[1],
                   cpu_fixed_s=rates.cpu_fixed_s + fixed - rates.job_fixed_s, job_fixed_s=fixed)


def measure_cpu_rates(host: BlockStack, lib: ctypes.CDLL, repeats: int = 3,
                      threads: int | None = None) -> tuple[float, float]:
    """``(cpu_s, cpu_fixed_s)`` of :class:`ShareRates` on this machine: the C job
    (:class:`~kernels.cpu.moe_job.MoeCpuJob`) over one token routed to 1 and to
    :data:`TIMED_EXPERTS` distinct experts of ``host``, every one the CPU's (best of
    ``repeats``); the slope is one more expert, the rest the fixed part. Where noise
    makes the slope zero or less, every expert costs ``time(n) / n`` and nothing is fixed
    (a zero rate would hand the CPU every expert). ``threads``: the job's (None:
    :func:`~kernels.cpu.threads.default_threads`)."""
    from kernels.cpu.moe_job import CPU_RUN, MoeCpuJob
    from kernels.cpu.threads import default_threads

    n = min(TIMED_EXPERTS, host.num_experts)
    job = MoeCpuJob(lib, host.gate, host.up, host.down, host.types, 1, n, torch.float32, torch.float32,
                    threads or default_threads(), pin=False)
    lut = torch.full((host.num_experts,), CPU_RUN, dtype=torch.int64)
    x = torch.randn(1, host.down.shape[1])
    times = {}
    for k in (1, n):
        ids = torch.tensor([list(range(k)) + [0] * (n - k)])  # the padding pairs are expert 0 too
        weights = torch.tensor([[1.0] * k + [0.0] * (n - k)])
        job.load(x, ids, weights, lut)
        job.run(1)  # first touch: the threads start, the blocks come near
        times[k] = best_time(lambda: job.run(1), repeats)
    per = (times[n] - times[1]) / max(n - 1, 1)
    if per <= 0:  # noise on a busy machine (n experts timed no slower than one): no fixed part
        return times[n] / n, 0.0
    return per, max(times[1] - per, 0.0)


def measure_bus_s(host: BlockStack, device: torch.device, repeats: int = 3) -> float:
    """Seconds the fused kernel takes a missing expert read over the bus: one token routed
    to :data:`TIMED_EXPERTS` distinct experts of ``host`` (pinned), none cached, on
    ``device`` (CUDA), best of ``repeats``, per expert."""
    n = min(TIMED_EXPERTS, host.num_experts)
    cache = host.empty(1, device)
    lut = torch.full((host.num_experts,), -1, dtype=torch.int64, device=device)
    x = torch.randn(1, host.down.shape[1], device=device, dtype=torch.bfloat16)
    ids = torch.arange(n, device=device)[None]
    weights = torch.full((1, n), 1.0 / n, device=device, dtype=torch.bfloat16)

    def run() -> None:
        host.moe(x, weights, ids, cache=cache, slot_of=lut)
        torch.cuda.synchronize(device)

    run()  # the kernels' compiles
    return best_time(run, repeats) / n
