"""The routing of requests in flight: which API call each engine sequence belongs to.

A :class:`Submission` is one API call's engine requests (``n`` sequences) and the queue
its events arrive on. :class:`InFlight` maps each request id sent to the worker to its
sequence, delivers the worker's outputs to the right queue, and, when a worker ends,
ends each sequence with an :class:`EngineFailure`, except those that had not produced a
token yet: each of those is kept, once, for the next worker (:meth:`InFlight.fail_all`
with ``retry``, then :meth:`InFlight.take_retries`).

Event-loop only: nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.wire.ipc import Rejected
from engine.wire.messages import AbortRequest, GenerateRequest, TokenOutput


@dataclass(frozen=True)
class EngineFailure:
    """A sequence ended without an answer because its worker ended or the service is
    shutting down (event on a :class:`Submission`'s queue). ``code`` is
    ``engine_restarted``, ``engine_failed`` or ``server_shutting_down``."""

    code: str
    message: str


# An event on a Submission's queue: (sequence index, what happened).
SequenceEvent = tuple[int, "TokenOutput | Rejected | EngineFailure"]


@dataclass(eq=False)
class Submission:
    """The engine requests of one API call (``n`` sequences), and their events.

    Events arrive on ``queue`` as ``(index, TokenOutput | Rejected | EngineFailure)``;
    each sequence ends with a finished ``TokenOutput``, a ``Rejected`` or an
    ``EngineFailure``. Call :meth:`InFlight.cancel` when done with it early.
    """

    request_ids: list[str]
    queue: asyncio.Queue[SequenceEvent] = field(default_factory=asyncio.Queue)
    closed: bool = False


@dataclass(eq=False)
class _Sequence:
    request: GenerateRequest
    index: int
    submission: Submission
    produced: bool = False
    retried: bool = False


class InFlight:
    """Sequences sent to the worker (by request id), and those waiting for the next one.

    Args:
        send: hands a message to the current worker (dropped when there is none).
        check_ready: raises (``NotReady``) unless a worker is ready to take new
            sequences; called before each submission.
    """

    def __init__(self, send: Callable[[Any], None], check_ready: Callable[[], object]) -> None:
        self._send = send
        self._check_ready = check_ready
        self._sent: dict[str, _Sequence] = {}
        self._waiting: list[_Sequence] = []

    def __len__(self) -> int:
        """Sequences sent to the worker and not finished yet."""
        return len(self._sent)

    @property
    def busy(self) -> bool:
        """Whether a sequence is unfinished, sent or waiting for a worker."""
        return bool(self._sent or self._waiting)

    def open_count(self) -> int:
        """Unfinished sequences whose caller still listens (sent or waiting)."""
        return sum(1 for s in (*self._sent.values(), *self._waiting) if not s.submission.closed)

    def submit(self, requests: list[GenerateRequest]) -> Submission:
        """Send ``requests`` (one per sequence, index = position) to the worker.

        Raises:
            NotReady: no worker is ready (from ``check_ready``); nothing was sent.
        """
        self._check_ready()
        submission = Submission([r.request_id for r in requests])
        for index, request in enumerate(requests):
            self._sent[request.request_id] = _Sequence(request, index, submission)
            self._send(request)
        return submission

    def cancel(self, submission: Submission) -> None:
        """Abort every unfinished sequence of ``submission`` in the engine and drop its
        future events. Idempotent."""
        submission.closed = True
        for request_id in submission.request_ids:
            self._abort(request_id)
        self._waiting = [s for s in self._waiting if s.submission is not submission]

    def abort_one(self, request_id: str) -> None:
        """Abort one sequence in the engine and drop its future events."""
        self._abort(request_id)
        self._waiting = [s for s in self._waiting if s.request.request_id != request_id]

    def _abort(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is not None:
            self._send(AbortRequest(request_id))

    def deliver(self, output: TokenOutput) -> None:
        """Put one output of the worker on its submission's queue."""
        seq = self._sent.get(output.request_id)
        if seq is None:
            return  # cancelled by its caller, or already ended
        if output.token_ids:
            seq.produced = True
        if output.finished:
            del self._sent[output.request_id]
        if not seq.submission.closed:
            seq.submission.queue.put_nowait((seq.index, output))

    def reject(self, message: Rejected) -> None:
        """End the sequence the worker refused, with the refusal."""
        seq = self._sent.pop(message.request_id, None)
        if seq is not None and not seq.submission.closed:
            seq.submission.queue.put_nowait((seq.index, message))

    def fail_all(self, code: str, message: str, *, retry: bool) -> None:
        """End every in-flight sequence with an EngineFailure, except (``retry``) those
        that produced nothing yet and were never retried: they wait for the next worker."""
        sent, self._sent = self._sent, {}
        pending = list(sent.values())
        if not retry:
            pending += self._waiting
            self._waiting = []
        for seq in pending:
            if seq.submission.closed:
                continue
            if retry and not seq.produced and not seq.retried:
                seq.retried = True
                self._waiting.append(seq)
                continue
            seq.submission.queue.put_nowait((seq.index, EngineFailure(code, message)))

    def resend_waiting(self) -> list[str]:
        """Send the sequences kept for this worker again; returns their request ids."""
        waiting, self._waiting = self._waiting, []
        sent = []
        for seq in waiting:
            if seq.submission.closed:
                continue
            self._sent[seq.request.request_id] = seq
            self._send(seq.request)
            sent.append(seq.request.request_id)
        return sent
