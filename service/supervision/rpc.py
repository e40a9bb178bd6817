"""Request and answer over the worker's pipe: a sequence number per call, a future per
number.

The worker answers a numbered request (``StatsRequest``, a replan command) with a
message carrying the same ``seq``; :class:`Calls` matches the two. Event-loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Calls(Generic[T]):
    """Open calls of one kind, by sequence number (from 1, per instance)."""

    def __init__(self) -> None:
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[T | None]] = {}

    async def call(
        self,
        send: Callable[[int], None],
        timeout_s: float,
        moved_at: Callable[[], float] | None = None,
    ) -> T | None:
        """``send(seq)`` the request, then wait for :meth:`answer` with that ``seq``.

        Args:
            send: sends the request numbered ``seq``.
            timeout_s: seconds to wait for the answer; with ``moved_at``, seconds
                without progress.
            moved_at: when the answering side last moved on (``time.monotonic()``
                seconds; the worker's work counter, :mod:`service.supervision.liveness`):
                the wait goes on while that is less than ``timeout_s`` ago, so a long
                command that advances is waited for to its end.

        Returns:
            The answer, or None when none came in time or the call was ended by
            :meth:`end_all`.
        """
        self._seq += 1
        seq = self._seq
        future: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = future
        try:
            send(seq)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(future), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    if moved_at is None:
                        return None
                    deadline = max(deadline, moved_at() + timeout_s)
                    if deadline <= time.monotonic():
                        return None
        finally:
            self._waiting.pop(seq, None)

    def answer(self, seq: int, value: T) -> None:
        """The answer to call ``seq`` (ignored when nobody waits for it any more)."""
        future = self._waiting.get(seq)
        if future is not None and not future.done():
            future.set_result(value)

    def end_all(self) -> None:
        """End every open call with None (the worker that would answer is gone)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_result(None)
