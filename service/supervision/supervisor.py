"""The supervisor: keeps one engine worker alive (the lifecycle state machine).

The traffic with the current worker, the API's sequences included, goes through its
:class:`~service.supervision.link.WorkerLink` (:attr:`Supervisor.link`), which the
supervisor attaches to each new worker and detaches at its exit; every message of the
worker arrives there, and only the lifecycle's own (ready, an error, engine events) come
on here. The health summary is :func:`service.supervision.report.health_report`.

States: ``starting`` (first spawn) -> ``ready`` -> ``restarting`` (worker died or
hung; back to ``ready``) ... -> ``failed`` (a crash loop, or the first load failed),
and ``stopped`` at shutdown. Without a worker, and without failing
(:mod:`service.common.engine_states`): ``waiting_for_memory`` (the plan would fit once
other processes free memory; :mod:`service.supervision.waits` watches the VRAM source),
``waiting_for_gpu`` (CUDA does not start, or broke; retried with backoff), ``paused``
(:meth:`Supervisor.pause`, :meth:`Supervisor.resume`) and ``idle`` (unloaded after
``keep_alive_s`` without requests; :meth:`Supervisor.ready` loads it again for the next
request). A worker's exit in those states is never a crash.

When a worker ends, every sequence in flight ends with an ``EngineFailure``, except
those that had not produced a token yet: each is sent again, once, to the next worker
(:mod:`service.supervision.inflight`). New work is refused with ``NotReady`` (HTTP 503
+ Retry-After) until the worker is back. Restarts back off, and a crash loop moves to
``failed`` (:mod:`service.supervision.restarts`), which reports the last exit code,
signal and the worker's last lines. Stale workers of an earlier run are ended at start,
and a restart waits for the dead worker's memory (:mod:`service.supervision.guard`); a
hung worker is killed by :mod:`service.supervision.watchdog`.

Graceful shutdown (:mod:`service.http.shutdown` drives it on SIGTERM/SIGINT):
:meth:`Supervisor.begin_shutdown` moves to ``stopped`` at once, so new work is refused
(503 + Retry-After) while what is in flight runs on; :meth:`Supervisor.drain` waits for
it up to a deadline, then ends each remaining sequence with ``server_shutting_down``;
:meth:`Supervisor.stop` then stops the worker. A worker that exits meanwhile is never
restarted.

Replan commands, fresh counters and the pool's figures are the link's
(:meth:`~service.supervision.link.WorkerLink.run_command`,
:attr:`~service.supervision.link.WorkerLink.pool`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from engine.wire.ipc import EngineEvents, FromWorker, Ready, WorkerError
from engine.wire.messages import EngineEvent, EngineInfo, EngineStats
from service.events.hub import EventHub
from service.events.schemas import EngineInfoEvent, HealthEvent, PlanEvent, WorkerEvent
from service.supervision.config import SupervisorConfig
from service.supervision.engine_events_to_ui import take_engine_event
from service.supervision.guard import StaleGuard, wait_for_release
from service.supervision.link import WorkerLink
from service.supervision.release import ReleaseResult
from service.supervision.report import exited_event, health_report, memory_wait_event, publish
from service.supervision.restarts import RestartPolicy
from service.common.engine_states import (
    ENGINE_FAILED,
    ENGINE_PAUSED,
    ENGINE_RESTARTED,
    SHUTDOWN_MESSAGE,
    SHUTTING_DOWN,
    UNLOADED,
    NotReady,
    State,
    first_line,
)
from service.supervision.waits import (
    GpuBackoff,
    MemoryWait,
    cuda_fault,
    misfit_to_wait_for,
    sleep_or_gpu_appears,
    wait_for_memory,
)
from service.supervision.watchdog import watch
from service.supervision.worker_process import ExitStatus, WorkerProcess

log = logging.getLogger("headroom.supervisor")

# Seconds a worker being unloaded (paused, idle) may take to exit before it is killed.
UNLOAD_TIMEOUT_S = 15.0


class Supervisor:
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
            asked for by the link's ``fresh_stats``).

    Attributes:
        events: the event hub the supervisor publishes ``health``, ``worker``,
            ``engine`` and ``plan`` events to (None: publish nothing).
        vram_source: a ``sample()``-able VRAM source (:mod:`service.vram.sources`) to wait on
            for a dead worker's memory before a restart (None: no wait).
        on_first_ready: called once, when the first worker is ready.
        link: the traffic with the current worker (requests in flight, commands,
            counters, pool figures, liveness).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        on_ready: Callable[[EngineInfo], Awaitable[None]] | None = None,
        on_engine_event: Callable[[EngineEvent], None] | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self.config = config
        self.on_ready = on_ready
        self.on_engine_event = on_engine_event
        self.on_stats = on_stats
        self.events: EventHub | None = None
        self.vram_source: Any = None
        self.on_first_ready: Callable[[], None] | None = None
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
        self._restarts = RestartPolicy(
            config.backoff_initial_s, config.backoff_max_s, config.max_exits, config.exit_window_s
        )
        self._last_load_s = 5.0
        self._restart_at: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self._first_start = True
        self._asked_restart: str | None = None  # who asked for the kill under way
        self.first_start_done: asyncio.Event | None = None
        # Set by begin_shutdown: when the drain ends (time.monotonic()), for Retry-After.
        self._drain_until: float | None = None
        # The worker's config; a wait for memory on a simulated card plans the next one
        # on the memory the card shows then.
        self._worker_config = config.worker
        self.memory_wait: MemoryWait | None = None
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

    # -- requests --------------------------------------------------------------------

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
                to wait for memory or the GPU).
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

    # -- worker events (event loop thread) -----------------------------------------------

    def _on_message(self, worker: WorkerProcess, message: FromWorker) -> None:
        """A lifecycle message of the current worker (the link routes the traffic)."""
        if isinstance(message, EngineEvents):
            for event in message.events:
                self._on_engine_event(event)
        elif isinstance(message, Ready):
            self._spawn_task(self._become_ready(worker, message))
        elif isinstance(message, WorkerError):
            log.error("worker error (%s): %s", message.kind, first_line(message.message))
            if self.state in UNLOADED or self.state is State.STOPPED:
                return
            misfit = misfit_to_wait_for(message, self.vram_source) if message.during_load else None
            if misfit is not None:
                self._enter_memory_wait(MemoryWait(misfit, message.message))
                return
            if cuda_fault(message):
                self._enter_gpu_wait(message.message)
                return
            if message.during_load and self._first_start:
                # Nothing ever served: a start-up failure (a missing model, a memory plan
                # that does not fit: the same again on every try), reported, not retried.
                if message.kind in ("PlanDoesNotFit", "SettingRefused"):
                    reason = message.message  # it says what does not fit and what fixes it
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
        self.link.last_message_at = time.monotonic()
        first = self._first_start
        self._first_start = False
        self.failure_reason = None
        self._clear_waits()
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
        what = status.describe() + (f": {asked}" if asked else "")
        (log.info if asked else log.error)(
            "worker %s %s%s",
            worker.pid,
            what,
            "" if not status.last_lines else f"; last line: {status.last_lines[-1]}",
        )
        self._publish(exited_event(worker.pid, status, self.restarts, reason=what))
        now = time.monotonic()
        ran = was_ready and self.ready_since is not None
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
                f"{self.config.exit_window_s:.0f} s; last: {what}"
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
        self._spawn_task(self._restart_later(delay_s))

    async def _restart_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.state in (State.RESTARTING, State.STARTING) and self._worker is None:
            await self._wait_for_release()
        if self.state in (State.RESTARTING, State.STARTING) and self._worker is None:
            self.restarts += 1
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

    def _clear_waits(self) -> None:
        self.memory_wait = None
        self.wait_reason = None
        self._waking = False

    def _enter_memory_wait(self, wait: MemoryWait) -> None:
        """The plan does not fit until other processes free memory: wait for it (the
        worker is exiting; :meth:`_exited_unloaded` starts the wait)."""
        self.state = State.WAITING_FOR_MEMORY
        self._waking = False
        self.memory_wait = wait
        self.wait_reason = wait.describe()
        log.warning("waiting for GPU memory: %s", self.wait_reason)
        self._publish_health()

    def _enter_gpu_wait(self, reason: str) -> None:
        delay_s = self._gpu_backoff.next_delay_s()
        self.state = State.WAITING_FOR_GPU
        self._waking = False
        self.wait_reason = reason
        self._restart_at = time.monotonic() + delay_s
        log.warning("waiting for the GPU (next try in %.0f s): %s", delay_s, first_line(reason))
        self._publish_health()

    def _exited_unloaded(self, worker: WorkerProcess, status: ExitStatus) -> None:
        """The worker exited in a waiting, paused or idle state: no crash; what it
        carried ends (or waits for the next worker), and the wait begins."""
        log.info("worker %s %s (%s)", worker.pid, status.describe(), self.state.value)
        self._publish(exited_event(worker.pid, status, self.restarts))
        if self.state in (State.PAUSED, State.IDLE):
            self._inflight.fail_all(
                ENGINE_PAUSED, f"the engine was unloaded ({self.state.value}); retry", retry=False
            )
            if self._resume_pending:
                self._resume_pending = False
                self._start_unloaded(waking=True)
                return
        else:
            self._inflight.fail_all(
                ENGINE_RESTARTED, f"the engine is {self.state.value}; retry the request", retry=True
            )
        if self.state is State.WAITING_FOR_MEMORY:
            self._spawn_task(self._await_memory())
        elif self.state is State.WAITING_FOR_GPU:
            delay_s = max((self._restart_at or 0.0) - time.monotonic(), 0.0)
            self._spawn_task(self._await_gpu(delay_s))
        self._publish_health()

    async def _await_memory(self) -> None:
        wait, source = self.memory_wait, self.vram_source
        if wait is None or source is None:
            return
        sample = await wait_for_memory(
            source, wait, self.config.memory_settle_s, on_change=self._publish_health
        )
        if self.state is not State.WAITING_FOR_MEMORY or self._worker is not None:
            return
        if wait.misfit.simulated:
            # A simulated card's figures are the worker's config: plan on the card now.
            self._worker_config = _with_device_free(self._worker_config, sample.free_bytes)
        log.info(
            "%d MiB of GPU memory free for %.0f s: starting the worker",
            sample.free_bytes >> 20,
            self.config.memory_settle_s,
        )
        self._start_unloaded()

    async def _await_gpu(self, delay_s: float) -> None:
        await sleep_or_gpu_appears(self.vram_source, delay_s)
        if self.state is State.WAITING_FOR_GPU and self._worker is None:
            log.info("trying the GPU again")
            self._start_unloaded()

    def _start_unloaded(self, waking: bool = False) -> None:
        """Spawn a worker from a waiting, paused or idle state."""
        self.state = State.STARTING if self._first_start else State.RESTARTING
        self.memory_wait = None
        self.wait_reason = None
        self._waking = waking
        self._spawn_and_publish()

    def _spawn_and_publish(self) -> None:
        try:
            self._spawn()
        except OSError as exc:  # out of processes or file descriptors
            self._fail(f"could not start a worker process: {exc}")
            return
        self._publish_health()

    def _cancel_pending(self) -> None:
        self._restart_at = None
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()  # a pending restart or wait

    async def unload(self, state: State, reason: str) -> None:
        """Stop the worker and give its memory back, entering ``paused`` or ``idle``
        (``state``); ``reason`` is for people (health, events)."""
        assert state in (State.PAUSED, State.IDLE)
        self._cancel_pending()
        self.state = state
        self.memory_wait = None
        self.wait_reason = reason
        self._waking = False
        self._resume_pending = False
        log.info("unloading the engine (%s): %s", state.value, reason)
        self._publish_health()
        worker = self._worker
        if worker is not None:
            # Longer than a shutdown's wait: nothing hurries, and a worker that exits by
            # itself frees its memory as cleanly as a killed one but logs no kill.
            await worker.stop(timeout_s=UNLOAD_TIMEOUT_S)

    async def pause(self) -> str:
        """Game mode: stop the worker and give all its memory back until :meth:`resume`
        (or, with ``load_on_request``, a request)."""
        if self.state is State.PAUSED:
            return "already paused"
        pid = self.worker_pid if self.worker_alive else None
        await self.unload(
            State.PAUSED,
            "paused through the control API; POST /api/control/resume resumes it"
            + ("; a request resumes it" if self.config.load_on_request else ""),
        )
        return f"paused: worker {pid} stopped, its memory given back" if pid else "paused"

    def resume(self, by: str = "the control API") -> str:
        """Load the worker again from ``paused`` or ``idle``; in any other state there is
        nothing to resume (a worker runs, loads or is waited for)."""
        if self.state not in (State.PAUSED, State.IDLE):
            return f"nothing to resume: the engine is {self.state.value}"
        log.info("resuming the engine (%s), asked for by %s", self.state.value, by)
        if self._worker is not None:
            # Still stopping (an unload in progress): the next worker starts at its exit.
            self._resume_pending = True
            self._waking = True
            return "resuming once the worker being unloaded has stopped"
        self._cancel_pending()
        self._start_unloaded(waking=True)
        return "resuming: the worker is loading"

    def unload_idle(self) -> None:
        """Unload the worker for ``keep_alive_s`` without requests (``idle``)."""
        reason = (
            f"unloaded after {self.config.keep_alive_s:g} s without requests (--keep-alive); "
            "the next request loads it again"
        )
        self.state = State.IDLE  # at once: the watchdog asks only once
        self._spawn_task(self.unload(State.IDLE, reason))

    def idle_due(self, now: float) -> bool:
        """Whether a ready worker has been without requests for ``keep_alive_s``."""
        keep = self.config.keep_alive_s
        if keep is None or self.state is not State.READY:
            return False
        if self.link.in_flight:
            self.last_request_at = now
            return False
        return now - self.last_request_at >= keep

    def _fail(self, reason: str) -> None:
        """Enter ``failed``: no more restarts until :meth:`restart`."""
        log.error("engine failed: %s", first_line(reason))
        self._waking = False
        self.state = State.FAILED
        self.failure_reason = reason
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


def _with_device_free(config: Any, free_bytes: int) -> Any:
    """``config`` (a WorkerConfig) planning a simulated card with ``free_bytes`` free."""
    from dataclasses import replace

    engine = config.engine
    free = min(free_bytes, engine.device_total) if engine.device_total is not None else free_bytes
    return msgspec.structs.replace(config, engine=replace(engine, device_free=free))
