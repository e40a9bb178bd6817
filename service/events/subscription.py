"""One subscriber of the event hub (:class:`service.events.hub.EventHub`): its bounded
queue of published events, the snapshot or the missed events it starts from, and its
end.

A subscriber whose queue is full is dropped by the hub at once: its queue is emptied,
and its next :meth:`Subscription.get` raises :class:`SubscriptionClosed` with code
:data:`service.events.schemas.CLOSE_TOO_SLOW` (4008), the close code the WebSocket
then carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NamedTuple

from service.events.schemas import CLOSE_NORMAL, Event, Snapshot


class Published(NamedTuple):
    """An event as published: the struct and its JSON text (encoded once for all)."""

    event: Event
    text: str


class SubscriptionClosed(Exception):
    """The subscription ended: ``code`` is the WebSocket close code to use
    (:data:`CLOSE_TOO_SLOW` when dropped for reading too slowly)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"subscription closed ({code}): {reason}")
        self.code = code
        self.reason = reason


_CLOSED = object()


class Subscription:
    """One subscriber's view of the hub; made by
    :meth:`service.events.hub.EventHub.subscribe`, which passes its ``remove``.

    Attributes:
        snapshot: the state to start from, or None when resuming (then ``missed``
            holds the events after ``last_seq``, in order, possibly none).
        missed: events to apply before those from :meth:`get`.
        close_code / close_reason: set once closed.
    """

    def __init__(
        self,
        remove: Callable[[Subscription, int, str], None],
        queue_size: int,
        snapshot: Snapshot | None,
        missed: list[Published],
    ) -> None:
        self._remove = remove  # the hub's: unsubscribes and ends this one
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size + 1)
        self._limit = queue_size
        self.snapshot = snapshot
        self.missed = missed
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed_event = asyncio.Event()

    @property
    def needs_snapshot(self) -> bool:
        """True when the subscriber must start from :attr:`snapshot` (no resume)."""
        return self.snapshot is not None

    @property
    def closed(self) -> bool:
        return self.close_code is not None

    @property
    def pending(self) -> int:
        """Events waiting in the queue."""
        return self._queue.qsize()

    async def get(self) -> Published:
        """The next event.

        Raises:
            SubscriptionClosed: the subscription was closed or dropped; events still
                queued then are discarded (a dropped client reconnects and resumes).
        """
        if self.closed and self._queue.empty():
            raise SubscriptionClosed(self.close_code or CLOSE_NORMAL, self.close_reason)
        item = await self._queue.get()
        if item is _CLOSED:
            raise SubscriptionClosed(self.close_code or CLOSE_NORMAL, self.close_reason)
        return item

    def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Unsubscribe (idempotent); a waiting :meth:`get` raises SubscriptionClosed."""
        self._remove(self, code, reason)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the hub's side

    def offer(self, item: Published) -> bool:
        """Queue ``item``; False (nothing queued) when the queue is full."""
        if self._queue.qsize() >= self._limit:
            return False
        self._queue.put_nowait(item)
        return True

    def end(self, code: int, reason: str) -> None:
        """Close with ``code``: drop what is queued, wake a waiting :meth:`get`."""
        self.close_code, self.close_reason = code, reason
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_CLOSED)
        self.closed_event.set()
