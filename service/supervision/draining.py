"""The supervisor's graceful shutdown (:mod:`service.http.shutdown` drives it on
SIGTERM/SIGINT), a part of :class:`service.supervision.supervisor.Supervisor`.

:meth:`Draining.begin_shutdown` moves to ``stopped`` at once, so new work is refused
(503 + Retry-After) while what is in flight runs on; :meth:`Draining.drain` waits for
it up to a deadline, then ends each remaining sequence with ``server_shutting_down``;
:meth:`Draining.stop` then stops the worker. A worker that exits meanwhile is never
restarted.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from service.common.engine_states import ENGINE_FAILED, SHUTDOWN_MESSAGE, SHUTTING_DOWN, State

if TYPE_CHECKING:
    from service.supervision.inflight import InFlight
    from service.supervision.worker_process import WorkerProcess


class Draining:
    """Shutdown for the supervisor: refuse new work, let what runs finish, stop.

    Uses the supervisor's ``state``, its worker, the link and the sequences in flight.
    """

    state: State
    _drain_until: float | None
    _restart_at: float | None
    _tasks: set[asyncio.Task]
    _inflight: InFlight
    _worker: WorkerProcess | None

    def begin_shutdown(self, timeout_s: float) -> None:
        """Refuse new work from now on (:class:`NotReady`, state ``stopped``, Retry-After
        until the drain's end) while what is in flight runs on; no worker is restarted
        after this. ``timeout_s``: how long :meth:`drain` will wait, in seconds."""
        if self._drain_until is not None:
            return
        self._drain_until = time.monotonic() + timeout_s
        self.state = State.STOPPED
        self._restart_at = None
        for task in list(self._tasks):
            task.cancel()  # a pending restart, a new worker's preparation
        if self._worker is None:
            # No worker to finish them: sequences waiting for a restart end now.
            self._inflight.fail_all(SHUTTING_DOWN, SHUTDOWN_MESSAGE, retry=False)
        self._publish_health()

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`begin_shutdown` was called."""
        return self._drain_until is not None

    @property
    def draining(self) -> bool:
        """Whether sequences sent to a worker are still unfinished (or waiting for one)."""
        return self._inflight.busy

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Wait until nothing is in flight or ``timeout_s`` seconds passed, then end each
        remaining sequence with ``server_shutting_down``. Call after
        :meth:`begin_shutdown`. Returns how many sequences were ended that way."""
        deadline = time.monotonic() + timeout_s
        while self.draining and self.worker_alive and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        ended = self._inflight.open_count()
        self._inflight.fail_all(SHUTTING_DOWN, SHUTDOWN_MESSAGE, retry=False)
        return ended

    def end_drain_now(self) -> None:
        """End every sequence still in flight with ``server_shutting_down`` now (a
        second Ctrl-C); :meth:`drain` then returns at once."""
        self._inflight.fail_all(SHUTTING_DOWN, SHUTDOWN_MESSAGE, retry=False)

    async def stop(self) -> None:
        """Stop the worker (gracefully, then by force) and fail what is in flight."""
        self.state = State.STOPPED
        self._restart_at = None
        self._publish_health()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._tasks):
            task.cancel()
        worker, self._worker = self._worker, None
        self.link.detach()
        self._inflight.fail_all(ENGINE_FAILED, "the server is shutting down", retry=False)
        if worker is not None:
            await worker.stop()
            self._pids.forget(worker.pid)
        self._pids.close()
