"""The supervisor: keeps one engine worker alive (the lifecycle state machine).

The traffic with the current worker, the API's sequences included, goes through its
:class:`~service.supervision.link.WorkerLink` (:attr:`Supervisor.link`), which the
supervisor attaches to each new worker and detaches at its exit; every message of the
worker arrives there, and only the lifecycle's own (ready, an error, engine events) come
on here. The health summary is :func:`service.supervision.report.health_report`.

States: ``starting`` (first spawn, or a load after ``paused`` or ``idle``) ->
``ready`` -> ``restarting`` (worker died or hung, or a restart was asked for; back to
``ready``) ... -> ``failed`` (a crash loop, the first load failed, or a load failed on
the model's files, :data:`engine.common.load_errors.LOAD_ERROR_NAMES`),
and ``stopped`` at shutdown. Without a worker, and without failing
(:mod:`service.common.engine_states`): ``waiting_for_memory``, ``waiting_for_gpu``,
``paused`` and ``idle``, in :mod:`service.supervision.unloading`. Whether a request can
run now (and waking an idle worker for it) is :mod:`service.supervision.readiness`.

When a worker ends, every sequence in flight ends with an ``EngineFailure``, except
those that had not produced a token yet: each is sent again, once, to the next worker
(:mod:`service.supervision.inflight`). New work is refused with ``NotReady`` (HTTP 503
+ Retry-After) until the worker is back. Restarts back off, and a crash loop moves to
``failed`` (:mod:`service.supervision.restarts`), which reports the last exit code,
signal and the worker's last lines. Stale workers of an earlier run are ended at start,
and a restart waits for the dead worker's memory (:mod:`service.supervision.guard`); a
hung worker is killed by :mod:`service.supervision.watchdog`.

Graceful shutdown (begin, drain, stop) is :mod:`service.supervision.draining`. This
module holds the lifecycle itself: start, spawn, a worker's messages, ready, exit and
restart, failure, and publishing.

Replan commands, fresh counters and the pool's figures are the link's
(:meth:`~service.supervision.link.WorkerLink.run_command`,
:attr:`~service.supervision.link.WorkerLink.pool`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from engine.common.load_errors import LOAD_ERROR_NAMES
from engine.wire.ipc import EngineEvents, FromWorker, ModelFolder, Ready, WorkerError
from engine.wire.messages import EngineEvent, EngineInfo, EngineStats
from service.common.engine_states import (
    ENGINE_FAILED,
    ENGINE_RESTARTED,
    RESTART_HINT,
    SHUTDOWN_MESSAGE,
    SHUTTING_DOWN,
    UNLOADED,
    State,
    first_line,
)
from service.events.hub import EventHub
from service.events.schemas import EngineInfoEvent, HealthEvent, PlanEvent, WorkerEvent
from service.supervision.config import SupervisorConfig
from service.supervision.draining import Draining
from service.supervision.engine_events_to_ui import take_engine_event
from service.supervision.guard import StaleGuard, wait_for_release
from service.supervision.link import WorkerLink
from service.supervision.readiness import Readiness
from service.supervision.release import ReleaseResult
from service.supervision.report import exited_event, health_report, memory_wait_event, publish
from service.supervision.restarts import RestartPolicy
from service.supervision.unloading import Unloading
from service.supervision.waits import (
    OWN_MEMORY,
    GpuBackoff,
    MemoryWait,
    cuda_fault,
    misfit_to_wait_for,
)
from service.supervision.watchdog import watch
from service.supervision.worker_process import ExitStatus, WorkerProcess

log = logging.getLogger("headroom.supervisor")

class Supervisor(Readiness, Unloading, Draining):
    """Owns the worker process; see the module docstring for the states.

    Args:
        config: the supervisor's knobs, the worker's config inside.
        on_ready: awaited with the new :class:`EngineInfo` after a worker reports
            ready and before the state becomes ``ready`` (the service loads its
            tokenizer there). An exception in it counts as a failed start.
        on_engine_event: called (on the event loop) with each
            :class:`engine.wire.messages.EngineEvent` the worker reports (``OomEvent``,
            ``ReplanWanted``, ``Replanned``), in order, after the supervisor has logged it
            and before it updates :attr:`info` for a ``Replanned`` (the app passes
            :meth:`service.supervision.engine_events_to_ui.EngineEventsToUI.record_engine_event`).
        on_stats: called with the engine's counters of each heartbeat (periodic or
            asked for by the link's ``fresh_stats``), and with None when the worker exits.

    Attributes:
        events: the hub for its ``health``, ``worker``, ``engine``, ``plan`` events (None: none).
        vram_source: a ``sample()``-able VRAM source (:mod:`service.vram.sources`) to wait on
            for a dead worker's memory before a restart (None: no wait).
        on_first_ready: called once, when the first worker is ready.
        requests_waiting: whether requests taken are not sent yet (waiting for a load,
            prompts encoding): the keep-alive counts them as activity.
        restarts: workers started again after one died or hung, since the service
            started (a restart asked for through the control API is not counted).
        link: the traffic with the current worker (requests in flight, commands,
            counters, pool figures, liveness).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        on_ready: Callable[[EngineInfo], Awaitable[None]] | None = None,
        on_engine_event: Callable[[EngineEvent], None] | None = None,
        on_stats: Callable[[EngineStats | None], None] | None = None,
    ) -> None:
        self.config = config
        self.on_ready = on_ready
        self.on_engine_event = on_engine_event
        self.on_stats = on_stats
        self.events: EventHub | None = None
        self.vram_source: Any = None
        self.on_first_ready: Callable[[], None] | None = None
        self.requests_waiting: Callable[[], bool] = lambda: False
        # Called with a loading worker's model folder (its ModelFolder), before Ready.
        self.on_model_folder: Callable[[str], None] | None = None
        self.last_release: ReleaseResult | None = None
        self._last_worker_pid: int | None = None
        self._pids = StaleGuard(config.pidfile, config.guard_workers)
        self.state = State.STOPPED
        self.info: EngineInfo | None = None
        self.failure_reason: str | None = None
        self.last_exit: ExitStatus | None = None
        self.restarts = 0
        self.worker_pid: int | None = None
        # A tensor-parallel worker's other ranks (from its Ready), for the VRAM watcher.
        self.rank_pids: list[int] = []
        self.ready_since: float | None = None
        self._worker: WorkerProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The traffic with the current worker; the API's sequences and the commands
        # go through it, which checks readiness here first.
        self.link = WorkerLink(self.check_ready, lambda: self.on_stats, self._on_message)
        self._inflight = self.link.requests
        self._restarts = RestartPolicy(config.restart_limits)
        self._last_load_s = 5.0
        self._restart_at: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self._first_start = True
        self._asked_restart: str | None = None  # who asked for the kill under way
        self._kill_cause: str | None = None  # why the watchdog killed it (still a crash)
        self.first_start_done: asyncio.Event | None = None
        # Set by begin_shutdown: when the drain ends (time.monotonic()), for Retry-After.
        self._drain_until: float | None = None
        # The worker's config; a wait for memory on a simulated card plans the next one
        # on the memory the card shows then.
        self._worker_config = config.worker
        self.memory_wait: MemoryWait | None = None
        # The wait that started the current worker, if one did (misfit_to_wait_for's ``last``).
        self.last_memory_wait: MemoryWait | None = None
        # Why the service waits without a worker (waiting_for_gpu, paused, idle).
        self.wait_reason: str | None = None
        self._gpu_backoff = GpuBackoff(config.gpu_retry_initial_s, config.gpu_retry_max_s)
        # A request woke the worker (idle, or paused with load_on_request): requests wait
        # for it to load instead of a 503.
        self._waking = False
        self._resume_pending = False
        self.last_request_at = time.monotonic()

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """End stale workers of an earlier run, spawn the first worker and return (state
        ``starting``)."""
        self._loop = asyncio.get_running_loop()
        self.first_start_done = asyncio.Event()
        self.state = State.STARTING
        await self._pids.reap_stale()
        self._spawn()
        self._publish_health()
        self._watchdog = asyncio.create_task(watch(self), name="supervisor-watchdog")

    def restart(self, reason: str | None = None) -> None:
        """Kill the current worker (if any) and start a new one now, also from ``failed``
        (the crash-loop history is cleared). ``reason`` (who asked) is added to the
        exit's log line, ``worker`` event and errors, so it does not read as a crash."""
        self._restarts.clear()
        self.failure_reason = None
        self._clear_waits()
        if self._worker is not None and not self._worker.exited:
            self._asked_restart = reason
            self._worker.kill()  # the exit handler restarts it
        else:
            self.state = State.RESTARTING
            self._spawn()
            self._publish_health()

    def kill_hung(self, cause: str) -> None:
        """Kill the current worker for ``cause`` (the watchdog's words, e.g. ``"it sent
        no heartbeat for 30.1 s, past the stall timeout of 30 s"``): an exit like a crash
        (restarted, counted towards a crash loop) whose log line, ``worker`` event and
        errors say why, not only the signal."""
        if self._worker is not None and not self._worker.exited:
            self._kill_cause = cause
            self._worker.kill()

    def _spawn(self) -> None:
        assert self._loop is not None
        self._restart_at = None
        worker = WorkerProcess(
            self._worker_config,
            loop=self._loop,
            on_message=lambda m: self.link.receive(worker, m),
            on_exit=lambda s: self._on_exit(worker, s),
        )
        self._worker = worker
        self.link.attach(worker)
        worker.start()
        self.worker_pid = worker.pid
        self._last_worker_pid = worker.pid
        self._pids.record(worker.pid)
        self._publish(WorkerEvent(phase="started", pid=worker.pid, restarts=self.restarts))

    @property
    def worker(self) -> WorkerProcess | None:
        """The current worker process (loading, ready or just exited), or None."""
        return self._worker

    @property
    def worker_alive(self) -> bool:
        """Whether a worker process runs now (loading or ready)."""
        return self._worker is not None and not self._worker.exited

    # -- worker events (event loop thread) -----------------------------------------------

    def _on_message(self, worker: WorkerProcess, message: FromWorker) -> None:
        """A lifecycle message of the current worker (the link routes the traffic)."""
        if isinstance(message, EngineEvents):
            for event in message.events:
                self._on_engine_event(event)
        elif isinstance(message, ModelFolder):
            if self.on_model_folder is not None:
                self.on_model_folder(message.model_dir)
        elif isinstance(message, Ready):
            self._spawn_task(self._become_ready(worker, message))
        elif isinstance(message, WorkerError):
            log.error("worker error (%s): %s", message.kind, first_line(message.message))
            if self.state in UNLOADED or self.state is State.STOPPED:
                return
            last, self.last_memory_wait = self.last_memory_wait, None
            misfit = misfit_to_wait_for(message, self.vram_source, last) if message.during_load else None
            if misfit is not None:
                self._enter_memory_wait(MemoryWait(misfit, message.message))
                return
            own = message.misfit is not None and misfit_to_wait_for(message, self.vram_source) is not None
            if cuda_fault(message):
                self._enter_gpu_wait(message.message)
                return
            if message.during_load and (self._first_start or message.kind in LOAD_ERROR_NAMES):
                # Nothing ever served, or the model's files went bad since (damaged or
                # replaced while served): a failure the same again on every try (a missing
                # or damaged model, a memory plan that does not fit), reported, not retried.
                if message.kind in ("PlanDoesNotFit", "SettingRefused"):
                    reason = message.message  # it says what does not fit and what fixes it
                    reason += f"\n({OWN_MEMORY})" if own else ""
                else:
                    reason = f"the engine failed to load: {message.kind}: {message.message}"
                self._fail(reason)

    def _on_engine_event(self, event: EngineEvent) -> None:
        """Log one engine event (one line), hand it on, and keep :attr:`info`'s limits
        live (``/v1/models`` and the context check read them)."""
        info = self.info
        self.info = take_engine_event(event, self.on_engine_event, info)
        if self.info is not info:
            self._publish(EngineInfoEvent(info=msgspec.structs.replace(self.info, plan=None)))

    async def _become_ready(self, worker: WorkerProcess, ready: Ready) -> None:
        try:
            if self.on_ready is not None:
                await self.on_ready(ready.info)
        except Exception as exc:
            log.exception("could not prepare for the new engine")
            self._fail(f"could not prepare for the engine: {exc}")
            worker.kill()
            return
        if worker is not self._worker or worker.exited or self.state is State.STOPPED or self.state in UNLOADED:
            return
        self.info = ready.info
        self.rank_pids = list(ready.rank_pids)
        self._last_load_s = ready.load_s
        self.state = State.READY
        self.ready_since = time.monotonic()
        self.link.liveness.reset(time.monotonic())
        first = self._first_start
        self._first_start = False
        self.failure_reason = None
        self._clear_waits()
        self.last_memory_wait = None
        self._gpu_backoff.clear()
        self.last_request_at = time.monotonic()
        if self.first_start_done is not None:
            self.first_start_done.set()
        if first and self.on_first_ready is not None:
            try:
                self.on_first_ready()
            except Exception:
                log.exception("on_first_ready failed")
        self._publish(EngineInfoEvent(info=msgspec.structs.replace(ready.info, plan=None)))
        self._publish(PlanEvent(plan=ready.info.plan))
        self._publish_health()
        log.info(
            "engine ready: %s, %d context tokens, pid %d (load %.1f s)",
            ready.info.model_name,
            ready.info.max_context_tokens,
            ready.pid,
            ready.load_s,
        )
        for request_id in self._inflight.resend_waiting():
            log.info("retrying %s on the new worker", request_id)

    def _on_exit(self, worker: WorkerProcess, status: ExitStatus) -> None:
        if worker is not self._worker:
            return
        self._worker = None
        self.link.detach()
        if self.info is not None:
            # Its KV pool is given back: none until the next worker reports its own.
            self._publish(EngineInfoEvent(info=msgspec.structs.replace(self.info, plan=None, num_pages=0,
                                                                       kv_cache_bytes=0, kv_buffer_bytes=0)))
        self.last_exit = status
        self._pids.forget(worker.pid)
        if self.state is State.STOPPED:
            if self._drain_until is not None:
                # Shutting down (a signal to the whole process group may reach it): what
                # it carried ends now, and no restart is planned.
                log.info("worker %s %s during shutdown", worker.pid, status.describe())
                self._inflight.fail_all(SHUTTING_DOWN, SHUTDOWN_MESSAGE, retry=False)
            return
        if self.state in UNLOADED:
            self._exited_unloaded(worker, status)
            return
        was_ready = self.state is State.READY
        asked, self._asked_restart = self._asked_restart, None
        cause, self._kill_cause = self._kill_cause, None
        what = status.describe() + (f": {asked}" if asked else f" ({cause})" if cause else "")
        (log.info if asked else log.error)(
            "worker %s %s%s",
            worker.pid,
            what,
            "" if not status.last_lines else f"; last line: {status.last_lines[-1]}",
        )
        self._publish(exited_event(worker.pid, status, self.restarts, reason=what))
        now = time.monotonic()
        ran = was_ready and self.ready_since is not None
        if not asked:  # an exit asked for is no crash: neither a restart nor a loop
            self._restarts.record_exit(now, now - self.ready_since if ran else None)
        self.ready_since = None

        if self.state is State.FAILED:
            self._inflight.fail_all(
                ENGINE_FAILED, self.failure_reason or "the engine failed", retry=False
            )
            self._publish_health()
            return
        if self._restarts.crash_loop:
            self._fail(
                f"crash loop: the worker exited {self._restarts.recent_exits} times in "
                f"{self.config.restart_limits.exit_window_s:.0f} s; last: {what}"
            )
            return
        self._inflight.fail_all(
            ENGINE_RESTARTED,
            f"the engine worker {what} and is restarting; retry the request",
            retry=True,
        )
        self.state = State.RESTARTING if not self._first_start else State.STARTING
        delay_s = self._restarts.delay_s()
        self._restart_at = now + delay_s
        log.info("restarting the worker in %.1f s", delay_s)
        self._publish(WorkerEvent(phase="restarting", delay_s=delay_s, restarts=self.restarts))
        self._publish_health()
        self._spawn_task(self._restart_later(delay_s, crashed=not asked))

    async def _restart_later(self, delay_s: float, crashed: bool = True) -> None:
        """Spawn the next worker after ``delay_s`` seconds (and the last one's memory
        is released); counted in :attr:`restarts` when the last one ``crashed`` (or
        hung), not when a restart was asked for."""
        await asyncio.sleep(delay_s)
        if self.state in (State.RESTARTING, State.STARTING) and self._worker is None:
            await self._wait_for_release()
        if self.state in (State.RESTARTING, State.STARTING) and self._worker is None:
            self.restarts += int(crashed)
            self._spawn_and_publish()

    async def _wait_for_release(self) -> None:
        """Before a new worker plans: wait (bounded) until the VRAM source no longer
        shows the last worker's memory, its other ranks' too under tensor parallel (on
        every rank's GPU); log and publish what was seen."""
        pid, source = self._last_worker_pid, self.vram_source
        if pid is None or source is None:
            return
        for each in (pid, *self.rank_pids):
            result = await wait_for_release(each, source, self.config.release_timeout_s)
            if result is None:
                return
            self.last_release = result
            self._publish(memory_wait_event(each, result, self.restarts))
        self.rank_pids = []  # waited for: the next group's come with its Ready

    # -- waits, pause and idle ---------------------------------------------------------------

    def _spawn_and_publish(self) -> None:
        try:
            self._spawn()
        except OSError as exc:  # out of processes or file descriptors
            self._fail(f"could not start a worker process: {exc}")
            return
        self._publish_health()

    def _fail(self, reason: str) -> None:
        """Enter ``failed``: no more restarts until :meth:`restart`. Once the service
        has been up (a failure at the first start ends it), ``reason`` goes on with
        how to start it again (:data:`RESTART_HINT`): health, ``headroom status`` and
        every API error say it."""
        log.error("engine failed: %s", first_line(reason))
        self._waking = False
        self.state = State.FAILED
        self.failure_reason = reason if self._first_start else f"{reason}; {RESTART_HINT}"
        reason = self.failure_reason
        self._restart_at = None
        self._inflight.fail_all(ENGINE_FAILED, reason, retry=False)
        self._publish(WorkerEvent(phase="failed", reason=reason, restarts=self.restarts))
        self._publish_health()
        if self.first_start_done is not None:
            self.first_start_done.set()

    def _publish(self, event: Any) -> None:
        publish(self.events, event)

    def _publish_health(self) -> None:
        self._publish(HealthEvent.from_report(health_report(self)))

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
