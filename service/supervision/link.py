"""The traffic with the current engine worker, apart from its lifecycle: what is sent
to it and what its messages answer.

- the API's sequences (:class:`~service.supervision.inflight.InFlight`): sent, and
  their outputs and refusals routed back to their calls;
- numbered calls (:class:`~service.supervision.rpc.Calls`): fresh counters
  (``StatsRequest``) and replan commands, each answered with the same ``seq``;
- the figures each heartbeat and command answer carries: the engine's counters and
  the KV pool's (``engine.ipc.PoolStats``).

The lifecycle (:mod:`service.supervision.supervisor`) attaches each new worker and
detaches it when it exits. Event-loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.ipc import (
    ControlDone,
    FromWorker,
    Heartbeat,
    Outputs,
    PoolStats,
    Rejected,
    ReplanCommand,
    StatsRequest,
)
from engine.messages import EngineStats
from service.supervision.inflight import InFlight
from service.supervision.rpc import Calls
from service.supervision.worker_process import WorkerProcess

log = logging.getLogger("headroom.supervisor")


class WorkerLink:
    """The current worker's traffic.

    Args:
        check_ready: raises ``NotReady`` unless a worker is ready; called before each
            submission (:attr:`requests`), so nothing is sent while none is.
        on_stats: called with the engine's counters of each heartbeat and command
            answer (read per call, so it may be set after construction).

    Attributes:
        requests: the sequences in flight; the API submits and cancels through it.
        stats: the engine's counters from the last heartbeat or answer (None: none yet).
        pool: the KV pool's figures from the last heartbeat or answer (None: no
            worker, or an engine that cannot resize its pool).
    """

    def __init__(
        self,
        check_ready: Callable[[], object],
        on_stats: Callable[[], Callable[[EngineStats], None] | None],
    ) -> None:
        self._worker: WorkerProcess | None = None
        self._on_stats = on_stats
        self.requests = InFlight(self.send, check_ready)
        self.stats: EngineStats | None = None
        self.pool: PoolStats | None = None
        self._stats_calls: Calls[EngineStats] = Calls()
        self._commands: Calls[ControlDone] = Calls()

    def attach(self, worker: WorkerProcess) -> None:
        """Send to ``worker`` from now on (a new incarnation: no pool figures yet)."""
        self._worker = worker
        self.pool = None

    def detach(self) -> None:
        """The worker is gone: drop what is sent from now on and end the open calls."""
        self._worker = None
        self.pool = None
        self._stats_calls.end_all()
        self._commands.end_all()

    def send(self, message: Any) -> None:
        """Queue ``message`` for the current worker; dropped when there is none."""
        if self._worker is not None:
            self._worker.send(message)

    def receive(self, message: FromWorker) -> bool:
        """Take one message of the current worker if it is traffic (outputs, a refusal,
        an answer, a heartbeat); False for the others (the lifecycle's)."""
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
            return False
        return True

    async def fresh_stats(self, timeout_s: float) -> EngineStats | None:
        """Counters the worker reads now; None if it does not answer in ``timeout_s``
        seconds (or exits first)."""
        return await self._stats_calls.call(lambda seq: self.send(StatsRequest(seq)), timeout_s)

    async def command(
        self, kind: type[ReplanCommand], timeout_s: float, **fields: Any
    ) -> ControlDone | None:
        """Send ``kind(seq=..., **fields)`` and wait for its answer; None if none comes in
        ``timeout_s`` seconds (or the worker exits first)."""
        return await self._commands.call(lambda seq: self.send(kind(seq=seq, **fields)), timeout_s)

    def _take_stats(self, stats: EngineStats, pool: PoolStats | None) -> None:
        self.stats = stats
        self.pool = pool
        on_stats = self._on_stats()
        if on_stats is not None:
            try:
                on_stats(stats)
            except Exception:
                log.exception("could not record the engine's counters")
