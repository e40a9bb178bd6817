"""The traffic with the current engine worker, apart from its lifecycle: every message
it sends arrives here first, and what is sent to it leaves from here.

- the API's sequences (:class:`~service.supervision.inflight.InFlight`): sent, and
  their outputs and refusals routed back to their calls;
- numbered calls (:class:`~service.supervision.rpc.Calls`): fresh counters
  (:meth:`WorkerLink.fresh_stats`) and replan commands (:meth:`WorkerLink.run_command`,
  from :mod:`service.vram.watcher` and the control API), each answered with the same
  ``seq``;
- the figures each heartbeat and command answer carries: the engine's counters
  (:attr:`WorkerLink.stats`) and the KV pool's (``engine.wire.ipc.PoolStats``,
  :attr:`WorkerLink.pool`);
- the worker's liveness: when it last sent anything and last moved on
  (:class:`~service.supervision.liveness.Liveness`; the watchdog reads it).

The lifecycle's own messages (``Ready``, ``WorkerError``, ``EngineEvents``) are handed
to the supervisor (:mod:`service.supervision.supervisor`), which attaches each new
worker and detaches it when it exits. Event-loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine.wire.ipc import (
    ControlDone,
    FromWorker,
    Heartbeat,
    Outputs,
    PoolStats,
    Rejected,
    ReplanCommand,
    StatsRequest,
)
from engine.wire.messages import EngineStats
from service.common.engine_states import NotReady
from service.supervision.inflight import InFlight
from service.supervision.liveness import Liveness
from service.supervision.rpc import Calls
from service.supervision.worker_process import WorkerProcess

log = logging.getLogger("headroom.supervisor")


class WorkerLink:
    """The current worker's traffic.

    Args:
        check_ready: raises ``NotReady`` unless a worker is ready; called before each
            submission (:attr:`requests`) and command, so nothing is sent while none is.
        on_stats: called with the engine's counters of each heartbeat and command
            answer, and with None when the worker exits (read per call, so it may be set
            after construction).
        on_lifecycle: called with ``(worker, message)`` for each message of the
            current worker that is not traffic (``Ready``, ``WorkerError``,
            ``EngineEvents``).

    Attributes:
        requests: the sequences in flight; the API submits and cancels through it.
        stats: the engine's counters from the last heartbeat or answer (None: none yet,
            or no worker).
        pool: the KV pool's figures from the last heartbeat or answer (None: no
            worker, or an engine that cannot resize its pool).
        liveness: the current worker's last message and last progress
            (``time.monotonic()``; reset at its spawn and when it becomes ready).
    """

    def __init__(
        self,
        check_ready: Callable[[], object],
        on_stats: Callable[[], Callable[[EngineStats | None], None] | None],
        on_lifecycle: Callable[[WorkerProcess, FromWorker], None],
    ) -> None:
        self._worker: WorkerProcess | None = None
        self._check_ready = check_ready
        self._on_stats = on_stats
        self._on_lifecycle = on_lifecycle
        self.requests = InFlight(self.send, check_ready)
        self.stats: EngineStats | None = None
        self.pool: PoolStats | None = None
        self.liveness = Liveness()
        self._stats_calls: Calls[EngineStats] = Calls()
        self._commands: Calls[ControlDone] = Calls()

    def attach(self, worker: WorkerProcess) -> None:
        """Send to ``worker`` from now on (a new incarnation: no pool figures yet)."""
        self._worker = worker
        self.pool = None
        self.liveness.reset(time.monotonic())

    def detach(self) -> None:
        """The worker is gone: drop what is sent from now on and end the open calls. Its
        counters go with it (:attr:`stats` None, ``on_stats`` called with None): no
        worker holds pages, so none are reported as in use."""
        self._worker = None
        self.pool = None
        self.stats = None
        self._notify(None)
        self._stats_calls.end_all()
        self._commands.end_all()

    @property
    def in_flight(self) -> int:
        """Sequences sent to the worker and not finished yet."""
        return len(self.requests)

    def send(self, message: Any) -> None:
        """Queue ``message`` for the current worker; dropped when there is none."""
        if self._worker is not None:
            self._worker.send(message)

    def receive(self, worker: WorkerProcess, message: FromWorker) -> None:
        """Take one message of ``worker`` (dropped unless it is the current one): stamp
        its liveness, route traffic (outputs, a refusal, an answer, a heartbeat) and
        hand the rest to the lifecycle."""
        if worker is not self._worker:
            return  # a message from a previous incarnation
        self.liveness.heard(message, time.monotonic())
        if isinstance(message, Outputs):
            for output in message.outputs:
                self.requests.deliver(output)
        elif isinstance(message, Rejected):
            self.requests.reject(message)
        elif isinstance(message, ControlDone):
            self._take_stats(message.stats, message.pool)
            self._commands.answer(message.seq, message)
        elif isinstance(message, Heartbeat):
            self._take_stats(message.stats, message.pool)
            if message.seq is not None:
                self._stats_calls.answer(message.seq, message.stats)
        else:
            self._on_lifecycle(worker, message)

    async def fresh_stats(self, timeout_s: float = 2.0) -> EngineStats | None:
        """Counters the worker reads now (not the last heartbeat's); the last ones
        (:attr:`stats`) when no worker is ready, None if the ready one does not answer
        in ``timeout_s`` seconds (or exits first)."""
        try:
            self._check_ready()
        except NotReady:
            return self.stats
        return await self._stats_calls.call(lambda seq: self.send(StatsRequest(seq)), timeout_s)

    async def run_command(
        self, kind: type[ReplanCommand], *, timeout_s: float = 30.0, **fields: Any
    ) -> ControlDone | None:
        """Send a replan command (``kind(seq=..., **fields)``) to the ready worker and
        wait for its answer; :attr:`pool` and :attr:`stats` are fresh when it returns.
        The wait lasts as long as the worker moves on (its work counter, which a long
        KV pool resize advances buffer by buffer: :attr:`liveness`), so a command that
        takes longer than ``timeout_s`` but advances is waited for to its answer.

        Returns:
            The worker's :class:`engine.wire.ipc.ControlDone`, or None when the worker ended
            (or made no progress for ``timeout_s`` seconds without answering).

        Raises:
            NotReady: no worker is ready; nothing was sent.
        """
        self._check_ready()
        return await self._commands.call(lambda seq: self.send(kind(seq=seq, **fields)), timeout_s,
                                         lambda: self.liveness.last_progress_at)

    def _take_stats(self, stats: EngineStats, pool: PoolStats | None) -> None:
        self.stats = stats
        self.pool = pool
        self._notify(stats)

    def _notify(self, stats: EngineStats | None) -> None:
        on_stats = self._on_stats()
        if on_stats is not None:
            try:
                on_stats(stats)
            except Exception:
                log.exception("could not record the engine's counters")
