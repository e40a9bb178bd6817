"""The simulated card (``--vram-source simulated``): a GPU that exists only in numbers,
for tests and demos.

- :class:`SimulatedSource` gives :class:`service.vram.sources.VramSample` like the real
  card's source, its other processes following a script;
- :func:`load_timeline` reads that script from a ``--vram-timeline`` JSON file
  (:class:`Timeline`: steps of other processes' memory, the card's size, when ``t = 0``
  is, the GPUs of a tensor-parallel worker);
- :func:`simulated_ours_bytes` is this service's memory on the card, as the worker's
  memory plan charges it, and :func:`simulated_sources` builds one source per rank from
  the settings.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.memory.plan import fmt_bytes
from engine.wire import ipc
from service.common.settings import ServeSettings, parse_size
from service.supervision.supervisor import Supervisor
from service.vram.sources import GpuProcess, VramSample, cpu_mode_sample, split_by_owner

log = logging.getLogger("headroom.vram")

# Other processes' demand for memory over time: ``(t_seconds, others_bytes)`` steps, or
# a function of ``t``.
Demand = Sequence[tuple[float, int]] | Callable[[float], int]
# A timeline step's start: seconds from ``t = 0``, or ``"file:PATH"`` (when PATH appears).
StepStart = float | str


class TimelineError(ValueError):
    """A ``--vram-timeline`` file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Timeline:
    """A parsed ``--vram-timeline`` file: ``steps`` of ``(seconds, others' bytes)``,
    the card's ``total_bytes`` and ``display`` when the file sets them, and the moment
    ``t = 0``: ``"ready"`` (the first worker is ready), ``"service"`` (start) or
    ``"file:PATH"`` (the first sample that finds PATH: a test or a demo script moves the
    other processes when it chooses, not after a guessed wait).
    ``baseline``: what becomes of the other processes' memory ``--device-free`` gave
    the plan at start: ``"kept"`` (it stays taken; the steps come on top) or
    ``"replaced"`` (the steps are all the other processes: they hold that memory until
    the first step, then what the steps say, so an app open at start can leave).
    ``gpu_at``: seconds before which the card is absent (a driver loading after a
    resume); None: always there. ``gpus``: steps of their own for some GPUs of a
    tensor-parallel worker (by rank); the others follow ``steps``."""

    steps: tuple[tuple[StepStart, int], ...]
    total_bytes: int | None = None
    display: bool | None = None
    start: str = "ready"
    baseline: Literal["kept", "replaced"] = "kept"
    gpu_at: float | None = None
    gpus: dict[int, tuple[tuple[StepStart, int], ...]] = field(default_factory=dict)


def _size(value: Any, total: int | None, where: str) -> int:
    if isinstance(value, str) and value.strip().endswith("%"):
        if total is None:
            raise TimelineError(f"{where}: a share of the card ({value}) needs a total")
        try:
            share = float(value.strip()[:-1]) / 100
        except ValueError:
            raise TimelineError(f"{where}: {value!r} is not a percentage") from None
        return int(share * total)
    try:
        return parse_size(value)
    except ValueError as exc:
        raise TimelineError(f"{where}: {exc}") from None


def load_timeline(path: str | Path, default_total: int | None = None) -> Timeline:
    """Read a timeline file (JSON)::

        {"total": "3GiB", "display": true, "start": "ready", "baseline": "kept",
         "gpu_at": 0, "steps": [[0, 0], [2, "40%"], [6, "1.6GiB"], [10, "40%"], [14, 0]]}

    Each step holds from its time (seconds) to the next, or from the first sample that
    finds a file when its time is ``"file:PATH"`` (and the steps before it have begun:
    ``[[0, 0], [1, "700MiB"], ["file:/tmp/leave", 0]]`` holds 700 MiB until a test
    writes /tmp/leave, not for a guessed time); sizes are bytes, text sizes
    (``service.common.settings.parse_size``) or a share of the card (``"40%"``);
    ``"start"`` is ``"ready"`` (default), ``"service"`` or ``"file:PATH"``. With
    ``--tensor-parallel-size N`` every rank's GPU follows ``steps`` unless ``"gpus"``
    gives it steps of its own, by rank: ``"gpus": {"1": [[0, 0], [3, "40%"]]}``.

    Raises:
        TimelineError: unreadable, not JSON, or a bad value (the message says which).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TimelineError(f"cannot read the VRAM timeline {path}: {exc}") from None
    except ValueError as exc:
        raise TimelineError(f"the VRAM timeline {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps", []), list):
        raise TimelineError(f'{path}: expected {{"steps": [[seconds, size], ...], ...}}')
    unknown = sorted(set(data) - _TIMELINE_KEYS)
    if unknown:
        raise TimelineError(f"{path}: unknown key {unknown[0]!r}; a timeline has {', '.join(sorted(_TIMELINE_KEYS))}")
    total = _size(data["total"], None, f"{path}: total") if "total" in data else default_total
    steps = _steps(data.get("steps", []), total, f"{path}: step")
    per_gpu = data.get("gpus", {})
    if not isinstance(per_gpu, dict) or not all(isinstance(v, list) for v in per_gpu.values()):
        raise TimelineError(f'{path}: "gpus" must map a rank to its steps: {{"1": [[seconds, size], ...]}}')
    gpus = {}
    for rank, gpu_steps in per_gpu.items():
        if not str(rank).isdigit():
            raise TimelineError(f'{path}: "gpus" names GPUs by rank (0, 1, ...), not {rank!r}')
        gpus[int(rank)] = _steps(gpu_steps, total, f"{path}: GPU {rank}'s step")
    start = data.get("start", "ready")
    if start not in ("ready", "service") and not _is_file_start(start):
        raise TimelineError(f'{path}: "start" must be "ready", "service" or "file:PATH", not {start!r}')
    baseline = data.get("baseline", "kept")
    if baseline not in ("kept", "replaced"):
        raise TimelineError(f'{path}: "baseline" must be "kept" or "replaced", not {baseline!r}')
    display = data.get("display")
    gpu_at = data.get("gpu_at")
    if gpu_at is not None and (isinstance(gpu_at, bool) or not isinstance(gpu_at, (int, float))):
        raise TimelineError(f'{path}: "gpu_at" must be seconds, not {gpu_at!r}')
    return Timeline(
        steps=steps,
        total_bytes=total,
        display=None if display is None else bool(display),
        start=start,
        baseline=baseline,
        gpu_at=None if gpu_at is None else float(gpu_at),
        gpus=gpus,
    )


def _is_file_start(start: Any) -> bool:
    return isinstance(start, str) and start.startswith("file:") and len(start) > len("file:")


_TIMELINE_KEYS = frozenset({"steps", "total", "display", "start", "baseline", "gpu_at", "gpus"})


def _steps(raw: list[Any], total: int | None, where: str) -> tuple[tuple[StepStart, int], ...]:
    """The steps of a timeline file, in order: a step of seconds at 0 or later and not
    before the step of seconds ahead of it (steps are played in the order written)."""
    steps: list[tuple[StepStart, int]] = []
    last = 0.0
    for i, step in enumerate(raw):
        if (not isinstance(step, list) or len(step) != 2 or isinstance(step[0], bool)
                or not (isinstance(step[0], (int, float)) or _is_file_start(step[0]))):
            raise TimelineError(f'{where} {i} is not [seconds, size] or ["file:PATH", size]: {step!r}')
        start = step[0] if isinstance(step[0], str) else float(step[0])
        if isinstance(start, float):
            if not math.isfinite(start) or start < last:
                raise TimelineError(f"{where} {i} starts at {step[0]!r} s: steps are in order of time, from 0 "
                                    f"(the one before starts at {last:g} s)")
            last = start
        steps.append((start, _size(step[1], total, f"{where} {i}")))
    return tuple(steps)


def file_triggered(steps: Sequence[tuple[StepStart, int]]) -> Callable[[float], int]:
    """Other processes' memory at ``t`` for steps in order, where a step whose start is
    ``"file:PATH"`` begins at the first sample (``t >= 0``) that finds PATH once the steps
    before it have begun, and a step of seconds at its time but never before the steps
    listed ahead of it."""
    found: dict[int, float] = {}

    def others(t: float) -> int:
        value = 0
        for i, (start, size) in enumerate(steps):
            if isinstance(start, str):
                if i not in found:
                    if t < 0 or not Path(start.removeprefix("file:")).exists():
                        break
                    found[i] = t
                    log.info("the simulated VRAM timeline's step %d begins (%s exists)", i, start.removeprefix("file:"))
                start = found[i]
            if t < start:
                break
            value = size
        return value

    return others


def simulated_ours_bytes(pool: ipc.PoolStats | None) -> int:
    """What the worker holds on a simulated card, as its plan counts it: the fixed sizes
    (the planned expert cache among them), the KV pool now, less what a lowered prefill
    chunk no longer needs, corrected by the expert cache's slots and the sliding-window
    ring pool's pages now (the fixed sizes hold the planned ones)."""
    if pool is None:
        return 0
    lowered = max(pool.planned_prefill_chunk - pool.prefill_chunk, 0)
    return max(
        pool.fixed_bytes
        + (pool.pages - 1) * pool.page_bytes
        + (pool.ring.bytes_past_start(pool.pages - 1) if pool.ring is not None else 0)
        - lowered * pool.activation_bytes_per_token
        + (pool.expert_slots - pool.planned_expert_slots) * pool.expert_slot_bytes,
        0,
    )




class SimulatedSource:
    """A GPU that exists only in numbers, whose other processes follow a script.

    Args:
        total_bytes: the card's size.
        timeline: other processes' demand for memory over time: a list of
            ``(t_seconds, others_bytes)`` steps (each holds from its time to the next;
            before the first, 0), or a function of ``t``. A sample shows what they can
            hold: at most what this service leaves of the card (the rest of a demand
            waits, as a game's allocations wait or fail, until memory is freed), so
            ``free`` is never negative and a service that gives memory back sees it
            taken.
        ours_bytes: this service's memory, a number or a function called at each sample
            (a test passes ``lambda: weights + engine.pool.nbytes``).
        processes: optional function of ``t`` giving the processes NVML would list
            (``(pid, name, bytes)``), for tests of :func:`service.supervision.release.wait_for_release`.
            Without it the others are anonymous (no pid attribution).
        own_pids: pids counted as ours among ``processes``.
        display_attached: whether a display is attached (moves the auto reserve).
        clock: the time ``t`` of a sample taken without an explicit ``at``; default
            seconds since this source was made.
        gpu_from: the time ``t`` before which the card is absent (CPU-mode samples, as
            NVML gives while a driver loads after a resume); None: always there.
    """

    def __init__(
        self,
        total_bytes: int,
        timeline: Demand = (),
        *,
        ours_bytes: int | Callable[[], int] = 0,
        processes: Callable[[float], Iterable[tuple[int, str, int]]] | None = None,
        own_pids: Iterable[int] = (),
        display_attached: bool = False,
        clock: Callable[[], float] | None = None,
        name: str = "simulated GPU",
        gpu_from: float | None = None,
    ) -> None:
        if total_bytes <= 0:
            raise ValueError(f"a simulated GPU needs a positive size, got {total_bytes}")
        if not callable(timeline):
            steps = sorted(timeline)
            if any(b < 0 for _, b in steps):
                raise ValueError("others' memory in a timeline must be >= 0 bytes")
            self._times = [t for t, _ in steps]
            self._values = [b for _, b in steps]
        self._timeline = timeline
        self.total_bytes = total_bytes
        self._ours = ours_bytes
        self._processes = processes
        self._own = frozenset(own_pids)
        self.display_attached = display_attached
        if clock is None:
            start = time.monotonic()

            def clock() -> float:
                return time.monotonic() - start

        self._clock = clock
        self.name = name
        self.gpu_from = gpu_from

    available = True
    simulated = True
    reason = ""

    def others_at(self, t: float) -> int:
        """Other processes' memory at time ``t`` per the script."""
        if callable(self._timeline):
            return max(int(self._timeline(t)), 0)
        i = bisect.bisect_right(self._times, t) - 1
        return self._values[i] if i >= 0 else 0

    def sample(self, at: float | None = None) -> VramSample:
        """The simulated card at time ``at`` (default: the clock's now)."""
        t = self._clock() if at is None else at
        if self.gpu_from is not None and t < self.gpu_from:
            return cpu_mode_sample(f"no GPU yet: the simulated GPU appears at t={self.gpu_from:g} s", t)
        ours = int(self._ours() if callable(self._ours) else self._ours)
        others = min(self.others_at(t), max(self.total_bytes - ours, 0))
        listed: tuple[GpuProcess, ...] = ()
        top: tuple[GpuProcess, ...] = ()
        if self._processes is not None:
            procs = {pid: int(b) for pid, _, b in self._processes(t)}
            names = {pid: n for pid, n, _ in self._processes(t)}
            _, _, listed, top = split_by_owner(procs, self._own, ours + others, lambda p: names[p])
        return VramSample(
            timestamp=t,
            gpu=True,
            device=self.name,
            total_bytes=self.total_bytes,
            free_bytes=max(self.total_bytes - others - ours, 0),
            ours_bytes=ours,
            others_bytes=others,
            display_attached=self.display_attached,
            top_consumers=top,
            processes=listed,
            pids_visible=self._processes is not None,
        )

    def close(self) -> None:
        pass


def simulated_sources(settings: ServeSettings, supervisor: Supervisor, ranks: int) -> list[Any]:
    """One simulated card per rank, each of ``--device-total`` and following its steps of
    the ``--vram-timeline`` (``"gpus"``, else ``"steps"``); the worker's memory on each
    is what its plan charges (the ranks' shards are alike)."""
    timeline = (
        load_timeline(settings.vram_timeline, settings.device_total)
        if settings.vram_timeline
        else Timeline(steps=())
    )
    total = timeline.total_bytes or settings.device_total
    if total is None:
        raise TimelineError("the simulated card needs a size: --device-total or a total")
    unknown = sorted(i for i in timeline.gpus if i >= ranks)
    if unknown:
        raise TimelineError(
            f"the VRAM timeline has steps for GPU {unknown[0]}, but the worker runs on {ranks} "
            f"GPU(s) (--tensor-parallel-size {settings.tensor_parallel_size}); number them 0 to {ranks - 1}"
        )
    # What the plan saw as taken by others at start (--device-free): it stays taken
    # under the steps, or until the first step when they replace it.
    baseline = 0
    if settings.device_free is not None and settings.device_total is not None:
        baseline = max(settings.device_total - settings.device_free, 0)
    on_top = baseline if timeline.baseline == "kept" else 0
    anchor: dict[str, float | None] = {"t0": time.monotonic()}
    if timeline.start == "ready":
        anchor["t0"] = None
        previous = supervisor.on_first_ready

        def on_first_ready() -> None:
            anchor["t0"] = time.monotonic()
            log.info("the simulated VRAM timeline starts now")
            if previous is not None:
                previous()

        supervisor.on_first_ready = on_first_ready

    if timeline.start.startswith("file:"):
        anchor["t0"] = None
        trigger = Path(timeline.start.removeprefix("file:"))

    def clock() -> float:
        t0 = anchor["t0"]
        if t0 is None and timeline.start.startswith("file:") and trigger.exists():
            t0 = anchor["t0"] = time.monotonic()
            log.info("the simulated VRAM timeline starts now (%s exists)", trigger)
        return -1.0 if t0 is None else time.monotonic() - t0

    def ours() -> int:
        return simulated_ours_bytes(supervisor.link.pool if supervisor.worker_alive else None)

    sources = []
    for rank in range(ranks):
        steps = [(-1e9, baseline), *((t, b + on_top) for t, b in timeline.gpus.get(rank, timeline.steps))]
        demand: Demand = file_triggered(steps) if any(isinstance(t, str) for t, _ in steps) else steps
        sources.append(
            SimulatedSource(
                total,
                demand,
                ours_bytes=ours,
                display_attached=settings.device_display if timeline.display is None else timeline.display,
                clock=clock,
                name=f"simulated GPU{f' {rank}' if ranks > 1 else ''} ({fmt_bytes(total)})",
                gpu_from=timeline.gpu_at,
            )
        )
    return sources
