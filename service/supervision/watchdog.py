"""The supervisor's watchdog: kill a worker that hung or never got ready; the
supervisor's exit handling then restarts it. It also unloads a ready worker left
without requests for ``keep_alive_s`` (the ``idle`` state).

A ready worker is killed when, for ``stall_timeout_s`` seconds, it sent nothing (a
stopped or frozen process) or made no progress: its heartbeats, sent from a thread
also during a step, carry a work counter the step's layers advance, and a counter that
stops moving with work to do means a stuck step, while a long step that moves on is
left alone (:mod:`service.supervision.liveness`). A worker not ready
``start_timeout_s`` seconds after it was spawned is killed too: loading, CUDA-graph
capture and the warm-up step come before ready. The check runs every heartbeat
interval (at most once a second, at least every 50 ms).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from service.common.engine_states import State

if TYPE_CHECKING:
    from service.supervision.config import SupervisorConfig
    from service.supervision.link import WorkerLink
    from service.supervision.worker_process import WorkerProcess

log = logging.getLogger("headroom.supervisor")


class Watched(Protocol):
    """What the watchdog reads and calls of the supervisor
    (:class:`service.supervision.supervisor.Supervisor`)."""

    config: SupervisorConfig
    state: State
    link: WorkerLink
    worker: WorkerProcess | None

    def idle_due(self, now: float) -> bool: ...

    def unload_idle(self) -> None: ...


async def watch(supervisor: Watched) -> None:
    """Run until cancelled, killing ``supervisor``'s worker when it hangs."""
    config = supervisor.config
    period_s = max(0.05, min(config.worker.heartbeat_interval_s, 1.0))
    # A killed worker stays `supervisor.worker` until it is reaped; kill (and log) once.
    killed = None
    while True:
        await asyncio.sleep(period_s)
        if supervisor.idle_due(time.monotonic()):
            supervisor.unload_idle()
            continue
        worker = supervisor.worker
        if worker is None or worker.exited or worker is killed:
            continue
        now = time.monotonic()
        if supervisor.state is State.READY:
            stalled = supervisor.link.liveness.stall(now, config.stall_timeout_s)
            if stalled is not None:
                log.error("worker %s %s, past the stall timeout of %.1f s; killing it", worker.pid, stalled,
                          config.stall_timeout_s)
                supervisor.kill_hung(f"hung: it {stalled}, past the stall timeout of "
                                     f"{config.stall_timeout_s:g} s")
                killed = worker
        elif supervisor.state in (State.STARTING, State.RESTARTING):
            if now - worker.started_at > config.start_timeout_s:
                log.error(
                    "worker %s not ready after %.0f s; killing it",
                    worker.pid,
                    config.start_timeout_s,
                )
                worker.kill()
                killed = worker
