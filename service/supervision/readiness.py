"""Whether the supervisor's worker can take work, a part of
:class:`service.supervision.supervisor.Supervisor`: the engine's facts while ``ready``,
else :class:`service.common.engine_states.NotReady` (HTTP 503) with the seconds after
which a retry makes sense; a request wakes an ``idle`` worker (and a ``paused`` one with
``--load-on-request``) and waits for it. :meth:`Readiness.ready_clock` counts only the seconds a worker was ready (a
request's ``--request-timeout`` runs on it: a load or a restart is not the request's
time).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from engine.wire.messages import EngineInfo
from service.common.engine_states import NotReady, State

if TYPE_CHECKING:
    from service.supervision.config import SupervisorConfig
    from service.supervision.worker_process import WorkerProcess


class Readiness:
    """The supervisor's answers to "can a request run now?" (waking an unloaded worker
    goes through its ``resume``, :class:`service.supervision.unloading.Unloading`)."""

    config: SupervisorConfig
    info: EngineInfo | None
    failure_reason: str | None
    wait_reason: str | None
    last_request_at: float
    _waking: bool
    _drain_until: float | None
    _restart_at: float | None
    _last_load_s: float
    _worker: WorkerProcess | None
    _state: State = State.STOPPED
    _unready_s: float = 0.0  # seconds not ``ready`` before ``_unready_since``
    # time.monotonic() the last ``ready`` ended (0: the clock starts at the first ready)
    _unready_since: float | None = 0.0

    @property
    def state(self) -> State:
        """The lifecycle state (:class:`service.common.engine_states.State`)."""
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        now = time.monotonic()
        if value is State.READY and self._unready_since is not None:
            self._unready_s += now - self._unready_since
            self._unready_since = None
        elif value is not State.READY and self._unready_since is None:
            self._unready_since = now
        self._state = value

    def ready_clock(self) -> float:
        """Seconds (``time.monotonic()``'s unit, arbitrary origin) that advance only
        while a worker is ``ready``: the difference of two readings is the time a
        worker could take work between them, without loads, restarts, pauses or
        waits for memory."""
        now = time.monotonic()
        unready = self._unready_s
        if self._unready_since is not None:
            unready += now - self._unready_since
        return now - unready

    def check_ready(self) -> EngineInfo:
        """The engine's facts if a worker is ready; raises :class:`NotReady` otherwise."""
        if self.state is State.READY and self.info is not None:
            return self.info
        raise NotReady(self.state, self.retry_after_s(), self.failure_reason or self.wait_reason)

    async def ready(self) -> EngineInfo:
        """As :meth:`check_ready`, but a request first wakes an ``idle`` worker (and a
        ``paused`` one with ``load_on_request``) and waits, up to the start timeout,
        for it to load.

        Raises:
            NotReady: no worker is ready (also when the woken one could not load, or has
                to wait for memory or the GPU; a load still going after
                ``--start-timeout-s`` says so).
        """
        # A generation request (not a poll of /v1/models or /api/ps): keeps it loaded.
        self.last_request_at = time.monotonic()
        if self.state is State.READY and self.info is not None:
            return self.check_ready()
        if self.state is State.IDLE or (self.state is State.PAUSED and self.config.load_on_request):
            self.resume(by="a request")
        if self._waking:
            deadline = time.monotonic() + self.config.start_timeout_s
            while (
                self.state in (State.STARTING, State.RESTARTING, State.PAUSED, State.IDLE)
                and self._waking
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.05)
            if self.state in (State.STARTING, State.RESTARTING) and self._waking:
                raise NotReady(self.state, self.retry_after_s(),
                               f"the model did not load within --start-timeout-s "
                               f"({self.config.start_timeout_s:g} s)")
        return self.check_ready()

    def retry_after_s(self) -> int | None:
        """Whole seconds until a worker is expected to be ready, or None in ``failed``;
        while shutting down, until the drain ends (at least 1: a service restarted by
        its manager may answer then), None once the worker is stopped."""
        if self.state is State.STOPPED and self._drain_until is not None:
            return max(1, math.ceil(self._drain_until - time.monotonic()))
        if self.state in (State.FAILED, State.STOPPED):
            return None
        if self.state is State.PAUSED:
            # No end is known; a client polling once a minute costs nothing.
            return 60
        if self.state is State.WAITING_FOR_MEMORY:
            return max(1, math.ceil(self.config.memory_settle_s + self._last_load_s))
        wait_s = self._last_load_s
        if self._restart_at is not None:
            wait_s += max(0.0, self._restart_at - time.monotonic())
        elif self._worker is not None and self.state is not State.READY:
            wait_s = max(0.0, self._worker.started_at + self._last_load_s - time.monotonic())
        return max(1, math.ceil(wait_s))
