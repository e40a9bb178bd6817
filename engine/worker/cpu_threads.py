"""How many threads torch's CPU kernels use, fitted to the cores other programs leave free.

torch's intra-op pool defaults to one thread per core. A decode step on the CPU is
thousands of small ops, each a parallel region that ends only when all its threads have
run; when another program keeps a core busy, the thread that shares that core runs a
scheduler time slice late at every region, and the whole step waits. Measured: the default
model on 2 cores with ``yes > /dev/null`` (and a test suite) beside it decoded 16 tokens in
21.7-52.8 s with 2 threads against 2.2 s with 1. So the worker sizes the pool to the cores
nobody else is using, between steps, at most once per ``interval_s``:

    threads = max(1, round(usable - busy_elsewhere))

``usable``: the cores this process may run on (``os.sched_getaffinity``); ``busy_elsewhere``:
their busy time over the last interval (``/proc/stat``) less this process's own
(``os.times``), in cores. A drop applies at once (a late thread costs 10x); a rise waits
until ``rise_after`` intervals in a row agree, so a burst elsewhere does not flap it. Where
``/proc/stat`` is absent (macOS, Windows) the count stays at ``usable``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("headroom.engine")

# (busy, total) jiffies summed over the given CPUs, or None where unreadable.
StatReader = Callable[[frozenset[int]], "tuple[int, int] | None"]


def usable_cores() -> frozenset[int]:
    """The CPU ids this process may run on (all of ``os.cpu_count()`` where affinity is
    not reported)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def read_proc_stat(cpus: frozenset[int], path: str = "/proc/stat") -> tuple[int, int] | None:
    """``(busy, total)`` jiffies since boot over ``cpus``, from the per-CPU lines of
    ``/proc/stat`` (``user nice system idle iowait irq softirq steal ...``; busy is all
    but idle and iowait; guest time is already inside user). None where unreadable."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in rest.split()[:8]]
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def own_cpu_seconds() -> float:
    """This process's user + system CPU time, all its threads, in seconds."""
    t = os.times()
    return t.user + t.system


@dataclass
class CpuThreads:
    """Decides the thread count (see the module docstring); :meth:`update` returns a new
    count to set, or None to keep the current one. ``fixed``: a count asked for
    (``--cpu-threads N``), never changed."""

    fixed: int | None = None
    interval_s: float = 1.0
    rise_after: int = 3
    cores: frozenset[int] = field(default_factory=usable_cores)
    read_stat: StatReader = read_proc_stat
    own_seconds: Callable[[], float] = own_cpu_seconds
    clock: Callable[[], float] = time.monotonic
    clock_ticks: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    current: int = 0
    _last: tuple[float, tuple[int, int], float] | None = None
    _rises: int = 0

    def __post_init__(self) -> None:
        self.current = self.fixed or len(self.cores)

    def update(self) -> int | None:
        if self.fixed is not None:
            return None
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return None
        stat = self.read_stat(self.cores)
        own = self.own_seconds()
        last, self._last = self._last, (now, stat, own) if stat is not None else None
        if last is None or stat is None:
            return None
        busy = stat[0] - last[1][0]
        total = stat[1] - last[1][1]
        if total <= 0:
            return None
        own_ticks = (own - last[2]) * self.clock_ticks
        elsewhere = max(0.0, (busy - own_ticks) / total * len(self.cores))
        want = max(1, min(len(self.cores), math.floor(len(self.cores) - elsewhere + 0.5)))
        if want < self.current:
            self._rises = 0
            return self._set(want, elsewhere)
        if want > self.current:
            self._rises += 1
            if self._rises >= self.rise_after:
                self._rises = 0
                return self._set(want, elsewhere)
        else:
            self._rises = 0
        return None

    def _set(self, want: int, elsewhere: float) -> int:
        log.info("CPU threads %d -> %d: other programs keep %.1f of %d cores busy",
                 self.current, want, elsewhere, len(self.cores))
        self.current = want
        return want


def parse_cpu_threads(value: str) -> int | None:
    """``--cpu-threads``: ``auto`` -> None (adapt), else the whole number asked for."""
    return None if value == "auto" else int(value)


__all__ = ["CpuThreads", "parse_cpu_threads", "read_proc_stat", "usable_cores"]


def fit_between_steps(setting: str = "auto") -> Callable[[], None]:
    """Set torch's CPU thread count now (``setting``: ``--cpu-threads``, "auto" or a
    number) and return the call that refits it between steps, as the worker's loop and
    ``headroom bench engine`` on the CPU make it."""
    import torch

    fit = CpuThreads(fixed=parse_cpu_threads(setting))
    torch.set_num_threads(fit.current)
    fit.update()  # opens the first window, so the first step already reads the load

    def between_steps() -> None:
        n = fit.update()
        if n is not None:
            torch.set_num_threads(n)

    return between_steps
