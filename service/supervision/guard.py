"""The supervisor's side of the stale-worker guard (:mod:`service.supervision.stale`).

At start, workers of an earlier run whose service is gone are ended; every worker is
listed in the pid file while it lives; and before a restarted worker plans, the
supervisor waits (bounded) until the VRAM source no longer shows the dead worker's
memory. Pid-file work reads ``/proc`` and may wait, so it runs on one thread, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.supervision import release, stale

log = logging.getLogger("headroom.supervisor")


class StaleGuard:
    """The list of live workers in ``pidfile`` (None: the default one); ``enabled``
    False does nothing (no reaping, no recording)."""

    def __init__(self, pidfile: Path | None, enabled: bool) -> None:
        self.pidfile = pidfile
        self.enabled = enabled
        self._ops = concurrent.futures.ThreadPoolExecutor(1, "headroom-pidfile")

    async def reap_stale(self) -> None:
        """End the workers of an earlier run whose service is gone (logs a failure)."""
        if not self.enabled:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._ops, stale.reap_stale_workers, self.pidfile
            )
        except OSError as exc:
            log.warning("could not check for stale workers: %s", exc)

    def record(self, pid: int | None) -> None:
        """List worker ``pid`` (in the background)."""
        self._submit(stale.record_worker, pid)

    def forget(self, pid: int | None) -> None:
        """Take worker ``pid`` off the list (in the background)."""
        self._submit(stale.forget_worker, pid)

    def close(self) -> None:
        """Finish the queued pid-file work; later calls do nothing."""
        self._ops.shutdown(wait=True)

    def _submit(self, fn: Callable[..., Any], pid: int | None) -> None:
        if not self.enabled or pid is None:
            return
        try:
            self._ops.submit(self._call, fn, pid)
        except RuntimeError:  # closed already
            pass

    def _call(self, fn: Callable[..., Any], pid: int) -> None:
        try:
            fn(pid, self.pidfile)
        except OSError as exc:
            log.warning("worker pid file: %s", exc)


async def wait_for_release(pid: int, source: Any, timeout_s: float) -> release.ReleaseResult | None:
    """Wait (in a thread, at most ``timeout_s`` seconds) until ``source`` (a VRAM
    source) no longer shows worker ``pid``'s memory; None when the wait itself failed
    (logged)."""
    try:
        return await asyncio.to_thread(release.wait_for_release, pid, source, timeout_s=timeout_s)
    except Exception:
        log.exception("could not wait for the memory of worker %d", pid)
        return None
