"""The supervisor: keeps one engine worker alive and routes requests through it.

States: ``starting`` (first spawn) -> ``ready`` -> ``restarting`` (worker died or
hung; back to ``ready``) ... -> ``failed`` (a crash loop, or the first load failed),
and ``stopped`` at shutdown.

When a worker ends, every in-flight sequence ends at once with
:class:`EngineFailure` (code ``engine_restarted``), except sequences that had not
produced a token yet: each of those is sent again, once, to the next worker. New work
is refused with :class:`NotReady` (HTTP 503 + Retry-After) until the worker is back.
Restarts back off exponentially; ``max_exits`` exits within ``exit_window_s`` move to
``failed``, which reports the last exit code, signal and the worker's last lines.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.ipc import (
    EngineEvents,
    FromWorker,
    Heartbeat,
    Outputs,
    Ready,
    Rejected,
    StatsRequest,
    WorkerConfig,
    WorkerError,
)
from engine.messages import (
    OOM_FAILED,
    AbortRequest,
    EngineEvent,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    OomEvent,
    ReplanWanted,
    TokenOutput,
)
from service.worker_process import ExitStatus, WorkerProcess

log = logging.getLogger("headroom.supervisor")

ENGINE_RESTARTED = "engine_restarted"
ENGINE_FAILED = "engine_failed"


def _first_line(text: str) -> str:
    """One log line of a many-line message (a plan's misfit and its fixes); the whole
    text is in the health report and in the start-up failure."""
    first, _, rest = text.partition("\n")
    return f"{first} (...)" if rest.strip() else first


class State(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class SupervisorConfig:
    """Knobs of the supervisor; times in seconds.

    ``stall_timeout_s``: a ready worker silent this long (no heartbeat) is killed and
    restarted. ``start_timeout_s``: a worker not ready this long after spawning is
    killed. ``backoff_initial_s`` doubles per consecutive exit up to ``backoff_max_s``;
    ``max_exits`` exits within ``exit_window_s`` mean a crash loop -> ``failed``.
    """

    worker: WorkerConfig
    stall_timeout_s: float = 30.0
    start_timeout_s: float = 900.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_exits: int = 5
    exit_window_s: float = 60.0


class NotReady(Exception):
    """No worker can take work now.

    Attributes:
        state: the supervisor's state.
        retry_after_s: seconds after which retrying makes sense, or None (``failed``).
        reason: why, for ``failed``.
    """

    def __init__(self, state: State, retry_after_s: int | None, reason: str | None) -> None:
        what = {
            State.STARTING: "the engine is starting",
            State.RESTARTING: "the engine is restarting",
            State.FAILED: "the engine has failed",
            State.STOPPED: "the server is shutting down",
        }.get(state, "the engine is not ready")
        message = what + (f": {reason}" if reason else "")
        if retry_after_s is not None:
            message += f"; retry in {retry_after_s} s"
        super().__init__(message)
        self.message = message
        self.state = state
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(frozen=True)
class EngineFailure:
    """A sequence ended without an answer because its worker ended (event on a
    :class:`Submission`'s queue). ``code`` is ``engine_restarted`` or ``engine_failed``."""

    code: str
    message: str


# An event on a Submission's queue: (sequence index, what happened).
Event = tuple[int, "TokenOutput | Rejected | EngineFailure"]


@dataclass(eq=False)
class _Sequence:
    request: GenerateRequest
    index: int
    submission: Submission
    produced: bool = False
    retried: bool = False


@dataclass(eq=False)
class Submission:
    """The engine requests of one API call (``n`` sequences), and their events.

    Events arrive on ``queue`` as ``(index, TokenOutput | Rejected | EngineFailure)``;
    each sequence ends with a finished ``TokenOutput``, a ``Rejected`` or an
    ``EngineFailure``. Call :meth:`Supervisor.cancel` when done with it early.
    """

    request_ids: list[str]
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    closed: bool = False


class Supervisor:
    """Owns the worker process; see the module docstring for the states.

    Args:
        config: the supervisor's knobs, the worker's config inside.
        on_ready: awaited with the new :class:`EngineInfo` after a worker reports
            ready and before the state becomes ``ready`` (the service loads its
            tokenizer there). An exception in it counts as a failed start.
        on_engine_event: called (on the event loop) with each
            :class:`engine.messages.OomEvent` and :class:`engine.messages.ReplanWanted`
            the worker reports, in order, after the supervisor has logged it.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        on_ready: Callable[[EngineInfo], Awaitable[None]] | None = None,
        on_engine_event: Callable[[EngineEvent], None] | None = None,
    ) -> None:
        self.config = config
        self.on_ready = on_ready
        self.on_engine_event = on_engine_event
        self.state = State.STOPPED
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None
        self.failure_reason: str | None = None
        self.last_exit: ExitStatus | None = None
        self.restarts = 0
        self.worker_pid: int | None = None
        self.ready_since: float | None = None
        self._worker: WorkerProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[str, _Sequence] = {}
        self._retry: list[_Sequence] = []
        self._exits: deque[float] = deque()
        self._consecutive_exits = 0
        self._last_load_s = 5.0
        self._restart_at: float | None = None
        self._last_message_at = 0.0
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._stats_seq = 0
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self._first_start = True
        self.first_start_done: asyncio.Event | None = None

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the first worker and return at once (state ``starting``)."""
        self._loop = asyncio.get_running_loop()
        self.first_start_done = asyncio.Event()
        self.state = State.STARTING
        self._spawn()
        self._watchdog = asyncio.create_task(self._watch(), name="supervisor-watchdog")

    async def stop(self) -> None:
        """Stop the worker (gracefully, then by force) and fail what is in flight."""
        self.state = State.STOPPED
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._tasks):
            task.cancel()
        worker, self._worker = self._worker, None
        self._fail_all(ENGINE_FAILED, "the server is shutting down", retry=False)
        if worker is not None:
            await worker.stop()

    def restart(self) -> None:
        """Kill the current worker (if any) and start a new one now, also from ``failed``
        (the crash-loop history is cleared)."""
        self._exits.clear()
        self._consecutive_exits = 0
        self.failure_reason = None
        if self._worker is not None and not self._worker.exited:
            self._worker.kill()  # the exit handler restarts it
        else:
            self.state = State.RESTARTING
            self._spawn()

    def _spawn(self) -> None:
        assert self._loop is not None
        self._restart_at = None
        self._last_message_at = time.monotonic()
        worker = WorkerProcess(
            self.config.worker,
            loop=self._loop,
            on_message=lambda m: self._on_message(worker, m),
            on_exit=lambda s: self._on_exit(worker, s),
        )
        self._worker = worker
        worker.start()
        self.worker_pid = worker.pid

    # -- requests --------------------------------------------------------------------

    def check_ready(self) -> EngineInfo:
        """The engine's facts if a worker is ready; raises :class:`NotReady` otherwise."""
        if self.state is State.READY and self.info is not None:
            return self.info
        raise NotReady(self.state, self.retry_after_s(), self.failure_reason)

    def submit(self, requests: list[GenerateRequest]) -> Submission:
        """Send ``requests`` (one per sequence, index = position) to the worker.

        Raises:
            NotReady: no worker is ready; nothing was sent.
        """
        self.check_ready()
        submission = Submission([r.request_id for r in requests])
        for index, request in enumerate(requests):
            seq = _Sequence(request, index, submission)
            self._inflight[request.request_id] = seq
            self._send(request)
        return submission

    def cancel(self, submission: Submission) -> None:
        """Abort every unfinished sequence of ``submission`` in the engine (its pages
        are freed) and drop its future events. Idempotent."""
        submission.closed = True
        for request_id in submission.request_ids:
            if self._inflight.pop(request_id, None) is not None:
                self._send(AbortRequest(request_id))
        self._retry = [s for s in self._retry if s.submission is not submission]

    def abort_one(self, request_id: str) -> None:
        """Abort one sequence in the engine (a stop string ended it) and drop its
        future events."""
        if self._inflight.pop(request_id, None) is not None:
            self._send(AbortRequest(request_id))
        self._retry = [s for s in self._retry if s.request.request_id != request_id]

    async def fresh_stats(self, timeout_s: float = 2.0) -> EngineStats | None:
        """Counters read by the worker now (not the last heartbeat's); None if no
        worker answers within ``timeout_s`` seconds."""
        if self._worker is None or self.state is not State.READY:
            return self.stats
        assert self._loop is not None
        self._stats_seq += 1
        seq = self._stats_seq
        future: asyncio.Future[EngineStats] = self._loop.create_future()
        self._stats_waiters[seq] = future
        self._worker.send(StatsRequest(seq))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            self._stats_waiters.pop(seq, None)

    def retry_after_s(self) -> int | None:
        """Whole seconds until a worker is expected to be ready, or None in ``failed``."""
        if self.state in (State.FAILED, State.STOPPED):
            return None
        wait_s = self._last_load_s
        if self._restart_at is not None:
            wait_s += max(0.0, self._restart_at - time.monotonic())
        elif self._worker is not None and self.state is not State.READY:
            wait_s = max(0.0, self._worker.started_at + self._last_load_s - time.monotonic())
        return max(1, math.ceil(wait_s))

    def health(self) -> dict[str, Any]:
        """A JSON-able summary: state, pid, model, restarts, last exit, failure reason."""
        report: dict[str, Any] = {
            "status": self.state.value,
            "worker_pid": self.worker_pid if self._worker and not self._worker.exited else None,
            "restarts": self.restarts,
            "in_flight": len(self._inflight),
        }
        if self.info is not None:
            report["model"] = self.info.model_name
        if self.ready_since is not None and self.state is State.READY:
            report["ready_for_s"] = round(time.monotonic() - self.ready_since, 1)
        if self.failure_reason:
            report["reason"] = self.failure_reason
        if self.last_exit is not None:
            report["last_exit"] = {
                "exit_code": self.last_exit.exit_code,
                "signal": self.last_exit.signal,
                "last_lines": list(self.last_exit.last_lines[-10:]),
            }
        if self.state in (State.STARTING, State.RESTARTING):
            report["retry_after_s"] = self.retry_after_s()
        return report

    # -- worker events (event loop thread) -----------------------------------------------

    def _send(self, message: Any) -> None:
        if self._worker is not None:
            self._worker.send(message)

    def _on_message(self, worker: WorkerProcess, message: FromWorker) -> None:
        if worker is not self._worker:
            return  # a message from a previous incarnation
        self._last_message_at = time.monotonic()
        if isinstance(message, Outputs):
            for output in message.outputs:
                self._deliver(output)
        elif isinstance(message, Heartbeat):
            self.stats = message.stats
            if message.seq is not None:
                future = self._stats_waiters.get(message.seq)
                if future is not None and not future.done():
                    future.set_result(message.stats)
        elif isinstance(message, Rejected):
            seq = self._inflight.pop(message.request_id, None)
            if seq is not None and not seq.submission.closed:
                seq.submission.queue.put_nowait((seq.index, message))
        elif isinstance(message, EngineEvents):
            for event in message.events:
                self._on_engine_event(event)
        elif isinstance(message, Ready):
            self._spawn_task(self._become_ready(worker, message))
        elif isinstance(message, WorkerError):
            log.error("worker error (%s): %s", message.kind, _first_line(message.message))
            if message.during_load and self._first_start:
                # Nothing ever served: a start-up failure (a missing model, a memory plan
                # that does not fit: the same again on every try), reported, not retried.
                if message.kind == "PlanDoesNotFit":
                    reason = message.message  # it says what does not fit and what fixes it
                else:
                    reason = f"the engine failed to load: {message.kind}: {message.message}"
                self._fail(reason)

    def _on_engine_event(self, event: EngineEvent) -> None:
        """Log one engine event (one line) and hand it on."""
        if isinstance(event, OomEvent):
            log.log(
                logging.ERROR if event.action == OOM_FAILED else logging.WARNING,
                "out of memory in %s for %s (%d tokens in the step): %s; %s",
                event.phase,
                event.request_id,
                event.tokens_in_step,
                event.action.replace("_", " "),
                event.message,
            )
        elif isinstance(event, ReplanWanted):
            log.warning(
                "the engine wants a new memory plan (prefill chunk cap now %d tokens): %s",
                event.new_max_prefill_tokens,
                event.reason,
            )
        if self.on_engine_event is not None:
            try:
                self.on_engine_event(event)
            except Exception:
                log.exception("could not record an engine event")

    def _deliver(self, output: TokenOutput) -> None:
        seq = self._inflight.get(output.request_id)
        if seq is None:
            return  # cancelled by its caller, or already ended
        if output.token_ids:
            seq.produced = True
        if output.finished:
            del self._inflight[output.request_id]
        if not seq.submission.closed:
            seq.submission.queue.put_nowait((seq.index, output))

    async def _become_ready(self, worker: WorkerProcess, ready: Ready) -> None:
        try:
            if self.on_ready is not None:
                await self.on_ready(ready.info)
        except Exception as exc:
            log.exception("could not prepare for the new engine")
            self._fail(f"could not prepare for the engine: {exc}")
            worker.kill()
            return
        if worker is not self._worker or worker.exited or self.state is State.STOPPED:
            return
        self.info = ready.info
        self._last_load_s = ready.load_s
        self.state = State.READY
        self.ready_since = time.monotonic()
        self._last_message_at = time.monotonic()
        self._first_start = False
        self.failure_reason = None
        if self.first_start_done is not None:
            self.first_start_done.set()
        log.info(
            "engine ready: %s, %d context tokens, pid %d (load %.1f s)",
            ready.info.model_name,
            ready.info.max_context_tokens,
            ready.pid,
            ready.load_s,
        )
        retry, self._retry = self._retry, []
        for seq in retry:
            if seq.submission.closed:
                continue
            log.info("retrying %s on the new worker", seq.request.request_id)
            self._inflight[seq.request.request_id] = seq
            self._send(seq.request)

    def _on_exit(self, worker: WorkerProcess, status: ExitStatus) -> None:
        if worker is not self._worker:
            return
        self._worker = None
        self.last_exit = status
        for future in self._stats_waiters.values():
            if not future.done():
                future.cancel()
        if self.state is State.STOPPED:
            return
        was_ready = self.state is State.READY
        log.error(
            "worker %s %s%s",
            worker.pid,
            status.describe(),
            "" if not status.last_lines else f"; last line: {status.last_lines[-1]}",
        )
        now = time.monotonic()
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.config.exit_window_s:
            self._exits.popleft()
        if self.ready_since is not None and was_ready and now - self.ready_since > 60.0:
            self._consecutive_exits = 0  # it ran well for a while: start the backoff over
        self._consecutive_exits += 1
        self.ready_since = None

        if self.state is State.FAILED:
            self._fail_all(ENGINE_FAILED, self.failure_reason or "the engine failed", retry=False)
            return
        if len(self._exits) >= self.config.max_exits:
            self._fail(
                f"crash loop: the worker exited {len(self._exits)} times in "
                f"{self.config.exit_window_s:.0f} s; last: {status.describe()}"
            )
            return
        self._fail_all(
            ENGINE_RESTARTED,
            f"the engine worker {status.describe()} and is restarting; retry the request",
            retry=True,
        )
        self.state = State.RESTARTING if not self._first_start else State.STARTING
        delay_s = min(
            self.config.backoff_max_s,
            self.config.backoff_initial_s * 2 ** (self._consecutive_exits - 1),
        )
        self._restart_at = now + delay_s
        log.info("restarting the worker in %.1f s", delay_s)
        self._spawn_task(self._restart_later(delay_s))

    async def _restart_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.state in (State.RESTARTING, State.STARTING) and self._worker is None:
            self.restarts += 1
            try:
                self._spawn()
            except OSError as exc:  # out of processes or file descriptors
                self._fail(f"could not start a worker process: {exc}")

    def _fail(self, reason: str) -> None:
        """Enter ``failed``: no more restarts until :meth:`restart`."""
        log.error("engine failed: %s", _first_line(reason))
        self.state = State.FAILED
        self.failure_reason = reason
        self._restart_at = None
        self._fail_all(ENGINE_FAILED, reason, retry=False)
        if self.first_start_done is not None:
            self.first_start_done.set()

    def _fail_all(self, code: str, message: str, *, retry: bool) -> None:
        """End every in-flight sequence with an EngineFailure, except (``retry``) those
        that produced nothing yet and were never retried: they wait for the next worker."""
        inflight, self._inflight = self._inflight, {}
        pending = list(inflight.values())
        if not retry:
            pending += self._retry
            self._retry = []
        for seq in pending:
            if seq.submission.closed:
                continue
            if retry and not seq.produced and not seq.retried:
                seq.retried = True
                self._retry.append(seq)
                continue
            seq.submission.queue.put_nowait((seq.index, EngineFailure(code, message)))

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        """Kill a worker that stopped beating (hung) or never got ready."""
        period_s = max(0.05, min(self.config.worker.heartbeat_interval_s, 1.0))
        while True:
            await asyncio.sleep(period_s)
            worker = self._worker
            if worker is None or worker.exited:
                continue
            now = time.monotonic()
            if self.state is State.READY:
                silent_s = now - self._last_message_at
                if silent_s > self.config.stall_timeout_s:
                    log.error(
                        "worker %s sent no heartbeat for %.1f s (stall timeout %.1f s); killing it",
                        worker.pid,
                        silent_s,
                        self.config.stall_timeout_s,
                    )
                    worker.kill()
            elif self.state in (State.STARTING, State.RESTARTING):
                if now - worker.started_at > self.config.start_timeout_s:
                    log.error(
                        "worker %s not ready after %.0f s; killing it",
                        worker.pid,
                        self.config.start_timeout_s,
                    )
                    worker.kill()
