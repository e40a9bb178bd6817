"""Waiting for a dead worker's memory before a new one plans (the restart-race guard's
second half; :mod:`service.supervision.stale` is the first).

A killed worker's memory returns to the device only once the driver has torn its
context down; a new worker planning before that would plan against a ghost.
:func:`wait_for_release` waits, bounded (10 s), until NVML no longer shows the dead
worker (or, where NVML cannot attribute memory by pid, until the process is gone and
the free memory stops rising).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.supervision.stale import is_alive

log = logging.getLogger("headroom.stale")


@dataclass(frozen=True)
class ReleaseResult:
    """What :func:`wait_for_release` saw: ``released`` (False: it gave up after the
    timeout), how long it waited, and why it stopped."""

    released: bool
    waited_s: float
    reason: str
    freed_bytes: int = 0


def wait_for_release(
    pid: int,
    source: Any,
    *,
    timeout_s: float = 10.0,
    poll_s: float = 0.1,
    stable_bytes: int = 16 << 20,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    alive: Callable[[int], bool] = is_alive,
) -> ReleaseResult:
    """Wait until the GPU memory of the (dead or dying) worker ``pid`` is back, at most
    ``timeout_s``. ``source`` gives :class:`service.vram.sources.VramSample` s (``sample()``).

    Released when: the source is in CPU mode (nothing to wait for); or NVML attributes
    memory by pid and no longer lists ``pid`` (or lists it with 0 bytes); or, where NVML
    lists no pids (a container), the process is gone and the free memory rose by less
    than ``stable_bytes`` between two samples (the driver has finished tearing it down).
    The result is logged either way; on timeout the caller plans anyway, against what
    NVML shows, and says so.
    """
    started = clock()
    first = source.sample()
    if not first.gpu:
        return ReleaseResult(True, 0.0, first.reason or "no GPU: nothing to wait for")
    last_free = first.free_bytes
    sample = first
    while True:
        waited = clock() - started
        held = sample.held_by(pid)
        if sample.pids_visible:
            if held is None or held == 0:
                res = ReleaseResult(
                    True,
                    waited,
                    f"NVML no longer shows pid {pid}",
                    sample.free_bytes - first.free_bytes,
                )
                break
        elif (
            not alive(pid) and sample is not first and sample.free_bytes - last_free < stable_bytes
        ):
            res = ReleaseResult(
                True,
                waited,
                f"pid {pid} is gone and the free memory has stopped rising",
                sample.free_bytes - first.free_bytes,
            )
            break
        if waited >= timeout_s:
            what = (
                f"still holds {held >> 20} MiB"
                if held
                else "may still hold memory (NVML shows no pids)"
            )
            res = ReleaseResult(
                False,
                waited,
                f"after {timeout_s:.0f} s, pid {pid} {what}",
                sample.free_bytes - first.free_bytes,
            )
            break
        last_free = sample.free_bytes
        sleep(poll_s)
        sample = source.sample()
        if not sample.gpu:
            res = ReleaseResult(
                True, clock() - started, sample.reason or "no GPU: nothing to wait for"
            )
            break
    if res.released:
        log.info("memory of worker pid %d released after %.2f s: %s", pid, res.waited_s, res.reason)
    else:
        log.warning("planning anyway: %s", res.reason)
    return res
