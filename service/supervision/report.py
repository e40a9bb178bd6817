"""What the supervisor reports: the health summary (``/api/health``, the ``health``
event), the worker events whose fields need assembling (an exit, the wait for a
dead worker's memory), and their way to the event hub (:func:`publish`).

Reads the supervisor's public state only; never changes it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from service.common.engine_states import UNLOADED, State
from service.events.schemas import WorkerEvent
from service.supervision.release import ReleaseResult
from service.supervision.worker_process import ExitStatus

if TYPE_CHECKING:
    from engine.wire.messages import EngineInfo
    from service.events.hub import EventHub
    from service.supervision.link import WorkerLink
    from service.supervision.waits import MemoryWait

log = logging.getLogger("headroom.supervisor")

# The worker's last lines a report carries (the newest).
LAST_LINES = 10


class Reported(Protocol):
    """What a health report reads of the supervisor
    (:class:`service.supervision.supervisor.Supervisor`)."""

    state: State
    worker_pid: int | None
    worker_alive: bool
    restarts: int
    link: WorkerLink
    info: EngineInfo | None
    ready_since: float | None
    failure_reason: str | None
    wait_reason: str | None
    memory_wait: MemoryWait | None
    last_exit: ExitStatus | None
    shutting_down: bool
    events: EventHub | None

    def retry_after_s(self) -> int | None: ...


def health_report(sup: Reported) -> dict[str, Any]:
    """A JSON-able summary: state, pid, model, restarts, last exit, the reason of a
    failure or a wait, ``retry_after_s`` while starting, restarting, waiting, paused,
    idle or draining, ``memory`` in ``waiting_for_memory`` (``needed_bytes`` free,
    ``free_bytes`` now, ``short_bytes``, ``top_consumers`` as pid/name/bytes,
    ``waiting_s``), and the event socket's subscribers (``event_subscribers``)."""
    report: dict[str, Any] = {
        "status": sup.state.value,
        "worker_pid": sup.worker_pid if sup.worker_alive else None,
        "restarts": sup.restarts,
        "in_flight": sup.link.in_flight,
    }
    if sup.info is not None:
        report["model"] = sup.info.model_name
    if sup.ready_since is not None and sup.state is State.READY:
        report["ready_for_s"] = round(time.monotonic() - sup.ready_since, 1)
    if sup.failure_reason or sup.wait_reason:
        report["reason"] = sup.failure_reason or sup.wait_reason
    if sup.memory_wait is not None and sup.state is State.WAITING_FOR_MEMORY:
        report["memory"] = sup.memory_wait.report()
    if sup.last_exit is not None:
        report["last_exit"] = {
            "exit_code": sup.last_exit.exit_code,
            "signal": sup.last_exit.signal,
            "last_lines": list(sup.last_exit.last_lines[-LAST_LINES:]),
        }
    if sup.state in (State.STARTING, State.RESTARTING) or sup.state in UNLOADED or sup.shutting_down:
        report["retry_after_s"] = sup.retry_after_s()
    if sup.events is not None:
        report["event_subscribers"] = sup.events.subscriber_count
    return report


def exited_event(
    pid: int | None, status: ExitStatus, restarts: int, *, reason: str | None = None
) -> WorkerEvent:
    """The ``worker`` event of an exit: its code, or the signal that killed it;
    ``reason`` replaces the plain description (e.g. to say who asked for the kill)."""
    return WorkerEvent(
        phase="exited",
        pid=pid,
        exit_code=status.exit_code if status.signal is None else None,
        signal=status.signal,
        reason=reason or status.describe(),
        restarts=restarts,
        last_lines=list(status.last_lines[-LAST_LINES:]),
    )


def memory_wait_event(pid: int, result: ReleaseResult, restarts: int) -> WorkerEvent:
    """The ``worker`` event saying whether dead worker ``pid``'s memory came back before
    the next one plans, and after how long."""
    what = "released" if result.released else "not released"
    return WorkerEvent(
        phase="restarting",
        pid=pid,
        reason=f"memory of worker {pid} {what} after {result.waited_s:.1f} s: {result.reason}",
        restarts=restarts,
    )


def publish(hub: EventHub | None, event: Any) -> None:
    """Hand ``event`` to ``hub``, if any; never raises (events are a view)."""
    if hub is None:
        return
    try:
        hub.publish(event)
    except Exception:
        log.exception("could not publish a %s event", type(event).__name__)
