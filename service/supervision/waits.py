"""The supervisor's waits without a worker: for GPU memory other processes hold
(``waiting_for_memory``) and for a GPU whose CUDA does not start (``waiting_for_gpu``).

:func:`wait_for_memory` samples the VRAM source until its free memory has stayed at or
above what the plan needs for the settle time; :func:`cuda_fault` tells a worker's
CUDA failure (wait for the GPU) from everything else; :class:`GpuBackoff` spaces the
retries. Torch-free, like the rest of the service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.memory.plan import fmt_bytes
from engine.wire.ipc import Misfit, WorkerError

# Default seconds the free memory must stay sufficient before the worker starts: a
# game that is closing frees its memory in steps over a second or two, and one that is
# starting grabs it in steps; a worker started on the first good sample would often plan
# on memory that is about to go.
DEFAULT_MEMORY_SETTLE_S = 3.0
# Waits for the GPU: the first retry after this many seconds, doubling up to the cap
# (a driver reloading after a resume takes seconds; a reboot-needing update, forever).
GPU_RETRY_INITIAL_S = 1.0
GPU_RETRY_MAX_S = 30.0


# Said of a misfit not waited for again (:func:`misfit_to_wait_for`'s ``last``).
OWN_MEMORY = ("the memory the plan counted as other processes' was free as soon as the worker had exited: it was "
              "the worker's own (NVML names no process of this card here, as inside a container), so no wait fixes it")


@dataclass
class MemoryWait:
    """What ``waiting_for_memory`` waits for, in bytes: ``needed_bytes`` free on the card
    (nothing of ours on it), ``free_bytes`` now, the largest other consumers now
    (``(pid, name, bytes)``), and since when (``time.monotonic()``)."""

    misfit: Misfit
    reason: str
    free_bytes: int = 0
    top_consumers: list[tuple[int, str, int]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)
    # Set by wait_for_memory: the first sample after the worker exited already showed the
    # memory free, so what the worker counted as other processes' was its own.
    free_at_once: bool = False

    @property
    def needed_bytes(self) -> int:
        return self.misfit.needed_free_bytes

    def report(self) -> dict[str, Any]:
        """The ``memory`` part of the health report."""
        return {
            "needed_bytes": self.needed_bytes,
            "free_bytes": self.free_bytes,
            "short_bytes": max(self.needed_bytes - self.free_bytes, 0),
            "top_consumers": [
                {"pid": pid, "name": name, "bytes": b} for pid, name, b in self.top_consumers
            ],
            "waiting_s": round(time.monotonic() - self.since, 1),
        }

    def describe(self) -> str:
        """One line for people: what is missing and who holds memory."""
        short = max(self.needed_bytes - self.free_bytes, 0)
        who = ", ".join(f"{name} (pid {pid}) {fmt_bytes(b)}" for pid, name, b in self.top_consumers[:3])
        return (
            f"other processes hold the GPU memory the model needs: {fmt_bytes(self.needed_bytes)} "
            f"must be free, {fmt_bytes(self.free_bytes)} is ({fmt_bytes(short)} short)"
            + (f"; largest: {who}" if who else "")
            + "; the engine starts when they free it"
        )


def misfit_to_wait_for(error: WorkerError, source: Any, last: MemoryWait | None = None) -> Misfit | None:
    """The misfit to wait out, or None when waiting cannot fix ``error``: not a plan that
    does not fit, one that would not fit without the other processes either (the model
    is larger than the card), no source to watch, a plan made for a simulated card while
    the source is a real one (its numbers never move), or a real card whose ``last``
    wait found the memory free at once (:data:`OWN_MEMORY`: waiting again would start the
    same worker again and again)."""
    misfit = error.misfit
    if misfit is None or not misfit.waitable or source is None:
        return None
    if last is not None and last.free_at_once and not misfit.simulated:
        return None
    if not getattr(source, "available", True):
        return None
    if misfit.simulated and not getattr(source, "simulated", False):
        return None
    return misfit


async def wait_for_memory(
    source: Any,
    wait: MemoryWait,
    settle_s: float,
    *,
    period_s: float = 0.25,
    on_change: Callable[[], None] | None = None,
) -> Any:
    """Sample ``source`` until its free memory has stayed at or above
    ``wait.needed_bytes`` for ``settle_s`` seconds; returns the last sample. Keeps
    ``wait``'s figures current and calls ``on_change`` when they move visibly (a change
    of at least 64 MiB, or other consumers)."""
    enough_since: float | None = None
    shown: tuple[int, list] | None = None
    first = True
    while True:
        sample = await asyncio.to_thread(source.sample)
        now = time.monotonic()
        if sample.gpu:
            # A card of --device-limit reads below zero when others hold more than it.
            wait.free_bytes = max(sample.free_bytes, 0)
            wait.top_consumers = [(p.pid, p.name, p.bytes) for p in sample.top_consumers]
            if shown is None or abs(shown[0] - wait.free_bytes) >= 64 << 20 or shown[1] != wait.top_consumers:
                shown = (wait.free_bytes, list(wait.top_consumers))
                if on_change is not None:
                    on_change()
            if sample.free_bytes >= wait.needed_bytes:
                wait.free_at_once = wait.free_at_once or first
                enough_since = now if enough_since is None else enough_since
                if now - enough_since >= settle_s:
                    return sample
            else:
                enough_since = None
        else:
            enough_since = None
        first = False
        await asyncio.sleep(period_s)


def cuda_fault(error: WorkerError) -> bool:
    """Whether the worker's error is CUDA that cannot start or broke (wait for the GPU),
    not an out-of-memory (the engine's own business) or anything else."""
    if error.kind == "CudaUnavailable":
        return True
    text = error.message.lower()
    if "out of memory" in text or error.kind == "OutOfMemoryError":
        return False
    return error.kind == "AcceleratorError" or "cuda error" in text or "cuda driver" in text


@dataclass
class GpuBackoff:
    """Seconds before the next try for the GPU: ``initial_s`` doubling to ``max_s``;
    :meth:`clear` once a worker is ready."""

    initial_s: float = GPU_RETRY_INITIAL_S
    max_s: float = GPU_RETRY_MAX_S
    attempts: int = 0

    def next_delay_s(self) -> float:
        delay = min(self.initial_s * (2**self.attempts), self.max_s)
        self.attempts += 1
        return delay

    def clear(self) -> None:
        self.attempts = 0


async def sleep_or_gpu_appears(source: Any, delay_s: float, period_s: float = 0.5) -> None:
    """Sleep ``delay_s`` seconds, or less when ``source`` (a VRAM source, or None) shows a
    GPU after showing none (a driver loaded, a simulated GPU that appears)."""
    deadline = time.monotonic() + delay_s
    seen_gpu: bool | None = None
    while (left := deadline - time.monotonic()) > 0:
        if source is not None:
            sample = await asyncio.to_thread(source.sample)
            if seen_gpu is False and sample.gpu:
                return
            seen_gpu = sample.gpu
        await asyncio.sleep(min(period_s, left))
