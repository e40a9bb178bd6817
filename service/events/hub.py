"""The event hub: typed events for the desktop app, fanned out to subscribers.

The events are the structs of :mod:`service.events.schemas`. :meth:`EventHub.publish` stamps each with ``seq`` (monotonic from 1, per
hub) and ``ts`` (Unix seconds, float), encodes it to JSON once, keeps it in a bounded
ring buffer (for resume) and hands it to every subscriber's bounded queue.

A new subscriber gets either a :class:`Snapshot` (the latest event of each kind, built
by the hub from the events it published, so a snapshot at ``seq`` N followed by the
events after N is exactly the state) or, when it resumes with ``last_seq`` and the
same ``epoch`` and those events are still buffered, the events it missed, in order.
Both are computed in the same synchronous call that registers it, so nothing
published in between is lost or doubled.

Slow subscribers never slow the hub: :meth:`EventHub.publish` never awaits. A
subscriber whose queue is full is dropped at once: it is unsubscribed, its queue is
emptied, and its next :meth:`~service.events.subscription.Subscription.get` raises
:class:`~service.events.subscription.SubscriptionClosed` with code
:data:`CLOSE_TOO_SLOW` (4008), the close code the WebSocket then carries.

``vram`` events are coalesced by a :class:`VramThrottle`: at most ``max_per_s`` a
second, except that a change of at least ``threshold_bytes`` in any figure goes out at
once (but never closer than ``min_gap_s`` to the previous one); a held sample is
published when its turn comes, so the latest value always reaches the UI.

Every method of the hub runs on the event loop's thread; from another thread use
:meth:`EventHub.publish_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

from engine.common.units import MiB
from service.events.schemas import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_TOO_SLOW,
    DEFAULT_BUFFER_SIZE,
    DEFAULT_KEEP_REPLANS,
    DEFAULT_KEEP_REQUEST_ERRORS,
    DEFAULT_QUEUE_SIZE,
    Event,
    ReplanEvent,
    RequestErrorEvent,
    Snapshot,
    VramEvent,
    WorkerEvent,
    encode,
)
from service.events.subscription import Published, Subscription

log = logging.getLogger("headroom.events")


# -- VRAM coalescing ------------------------------------------------------------------------


class VramThrottle:
    """Decides when a ``vram`` sample goes out.

    Args:
        max_per_s: at most this many samples a second in a steady stream.
        threshold_bytes: a change at least this large in total, free, ours, others',
            reserve or headroom goes out at once...
        min_gap_s: ...but never closer than this to the previous one.

    :meth:`offer` returns ``(True, None)`` to publish now, or ``(False, due)``: hold it
    (it replaces any held sample) and call :meth:`take_due` at monotonic time ``due``.
    """

    def __init__(
        self,
        *,
        max_per_s: float = 4.0,
        threshold_bytes: int = 128 * MiB,
        min_gap_s: float = 0.05,
    ) -> None:
        if max_per_s <= 0:
            raise ValueError("max_per_s must be > 0")
        self.interval_s = 1.0 / max_per_s
        self.threshold_bytes = threshold_bytes
        self.min_gap_s = min(min_gap_s, self.interval_s)
        self.last: VramEvent | None = None
        self.last_at: float | None = None
        self.pending: VramEvent | None = None

    def significant(self, new: VramEvent) -> bool:
        """Whether ``new`` differs from the last published sample past the threshold."""
        old = self.last
        if old is None or old.source != new.source or old.device != new.device:
            return True
        if [g.device for g in old.gpus] != [g.device for g in new.gpus]:
            return True
        # Each GPU of a tensor-parallel worker counts, not only the tightest one.
        return any(
            abs(a - b) >= self.threshold_bytes
            for was, now in ((old, new), *zip(old.gpus, new.gpus, strict=True))
            for a, b in (
                (was.total_bytes, now.total_bytes),
                (was.free_bytes, now.free_bytes),
                (was.ours_bytes, now.ours_bytes),
                (was.others_bytes, now.others_bytes),
                (was.reserve_bytes, now.reserve_bytes),
                (was.headroom_bytes, now.headroom_bytes),
            )
        )

    def offer(self, sample: VramEvent, now: float) -> tuple[bool, float | None]:
        if self.last_at is None:
            return True, None
        since = now - self.last_at
        gap = self.min_gap_s if self.significant(sample) else self.interval_s
        if since >= gap:
            return True, None
        self.pending = sample
        return False, self.last_at + gap

    def published(self, sample: VramEvent, now: float) -> None:
        """Record that ``sample`` went out at ``now`` (drops any held sample)."""
        self.last, self.last_at, self.pending = sample, now, None

    def take_due(self) -> VramEvent | None:
        """The held sample, if any (and forget it)."""
        sample, self.pending = self.pending, None
        return sample


# -- the hub -------------------------------------------------------------------------------------


class EventHub:
    """Publishes events to subscribers; see the module docstring.

    Args:
        buffer_size: events kept for resume.
        queue_size: events a subscriber may have waiting; one more drops it.
        keep_request_errors / keep_replans: how many of those a snapshot lists.
        vram_throttle: coalescing of ``vram`` events (default :class:`VramThrottle`()).
        clock: Unix time for ``ts`` (tests pass a fake one).
        monotonic: the clock of the VRAM throttle (default: the running loop's time).
    """

    def __init__(
        self,
        *,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        keep_request_errors: int = DEFAULT_KEEP_REQUEST_ERRORS,
        keep_replans: int = DEFAULT_KEEP_REPLANS,
        vram_throttle: VramThrottle | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        if buffer_size < 1 or queue_size < 1:
            raise ValueError("buffer_size and queue_size must be >= 1")
        self.epoch = secrets.token_hex(8)
        self.queue_size = queue_size
        self.seq = 0
        self.dropped = 0  # subscribers dropped for reading too slowly, ever
        self._buffer: deque[Published] = deque(maxlen=buffer_size)
        self._subs: set[Subscription] = set()
        self._clock = clock
        self._monotonic = monotonic
        self._throttle = vram_throttle or VramThrottle()
        self._vram_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._latest: dict[str, Event] = {}
        self._request_errors: deque[RequestErrorEvent] = deque(maxlen=keep_request_errors)
        self._replans: deque[ReplanEvent] = deque(maxlen=keep_replans)
        self._closed = False

    # -- state ------------------------------------------------------------------------

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)

    def snapshot(self) -> Snapshot:
        """The state as of :attr:`seq` (see :class:`Snapshot`)."""
        latest = self._latest
        return Snapshot(
            seq=self.seq,
            ts=self._clock(),
            epoch=self.epoch,
            health=latest.get("health"),  # type: ignore[arg-type]
            worker=latest.get("worker"),  # type: ignore[arg-type]
            last_exit=latest.get("last_exit"),  # type: ignore[arg-type]
            engine=latest.get("engine"),  # type: ignore[arg-type]
            plan=latest.get("plan"),  # type: ignore[arg-type]
            vram=latest.get("vram"),  # type: ignore[arg-type]
            counters=latest.get("counters"),  # type: ignore[arg-type]
            request_errors=list(self._request_errors),
            replans=list(self._replans),
        )

    def buffered(self) -> list[Event]:
        """The events still kept for resume, oldest first."""
        return [p.event for p in self._buffer]

    # -- publishing -------------------------------------------------------------------

    def publish(self, event: Event, *, coalesce: bool = True) -> Event | None:
        """Stamp ``event`` with the next ``seq`` and ``ts`` and deliver it.

        A :class:`VramEvent` goes through the throttle unless ``coalesce`` is False: it
        may be held (returns None) and published later, or replaced by a newer sample.
        Never awaits and never raises for a slow subscriber (it is dropped).

        Returns:
            The stamped event, or None when a VRAM sample was held.
        """
        if isinstance(event, VramEvent) and coalesce:
            return self._offer_vram(event)
        return self._emit(event)

    def publish_threadsafe(self, event: Event) -> None:
        """:meth:`publish` from another thread (e.g. an NVML poller); needs
        :meth:`attach_loop` (or a prior call on the loop)."""
        if self._loop is None:
            raise RuntimeError("EventHub.attach_loop() was not called")
        self._loop.call_soon_threadsafe(self.publish, event)

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Remember the event loop (default: the running one) for timers and
        :meth:`publish_threadsafe`."""
        self._loop = loop or asyncio.get_running_loop()

    def _emit(self, event: Event) -> Event:
        self.seq += 1
        stamped: Event = msgspec.structs.replace(event, seq=self.seq, ts=self._clock())
        item = Published(stamped, encode(stamped))
        self._buffer.append(item)
        self._remember(stamped)
        slow = [sub for sub in self._subs if not sub.offer(item)]
        for sub in slow:
            self.dropped += 1
            log.warning(
                "dropping an event subscriber: %d events waiting (it reads too slowly)",
                self.queue_size,
            )
            self._remove(sub, CLOSE_TOO_SLOW, "too slow: the event queue overflowed")
        return stamped

    def _remember(self, event: Event) -> None:
        if isinstance(event, RequestErrorEvent):
            self._request_errors.append(event)
        elif isinstance(event, ReplanEvent):
            self._replans.append(event)
        else:
            self._latest[event.__struct_config__.tag] = event  # type: ignore[index]
            if isinstance(event, WorkerEvent) and event.phase == "exited":
                self._latest["last_exit"] = event

    def _now_mono(self) -> float:
        if self._monotonic is not None:
            return self._monotonic()
        loop = self._running_loop()
        return loop.time() if loop is not None else time.monotonic()

    def _running_loop(self) -> asyncio.AbstractEventLoop | None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass
        return self._loop

    def _offer_vram(self, sample: VramEvent) -> Event | None:
        now = self._now_mono()
        go, due = self._throttle.offer(sample, now)
        if go:
            self._cancel_vram_timer()
            self._throttle.published(sample, now)
            return self._emit(sample)
        loop = self._running_loop()
        if loop is None:  # no loop to wait on: nothing may be lost, publish now
            self._throttle.published(sample, now)
            return self._emit(sample)
        if self._vram_timer is None:
            assert due is not None
            self._vram_timer = loop.call_later(max(0.0, due - now), self._flush_vram)
        return None

    def _flush_vram(self) -> None:
        self._vram_timer = None
        sample = self._throttle.take_due()
        if sample is not None and not self._closed:
            self._throttle.published(sample, self._now_mono())
            self._emit(sample)

    def _cancel_vram_timer(self) -> None:
        if self._vram_timer is not None:
            self._vram_timer.cancel()
            self._vram_timer = None

    # -- subscribing ------------------------------------------------------------------

    def subscribe(self, last_seq: int | None = None, epoch: str | None = None) -> Subscription:
        """Register a subscriber.

        Args:
            last_seq: the last ``seq`` the subscriber applied, to resume after.
            epoch: the ``epoch`` that ``seq`` came from (from its snapshot). A
                different epoch (another service run) means no resume.

        Returns:
            A :class:`Subscription` whose ``snapshot`` is set when it cannot resume
            (no ``last_seq``, another epoch, a ``seq`` from the future, or events after
            it no longer buffered), else whose ``missed`` lists the events after
            ``last_seq``, in order.

        Raises:
            RuntimeError: the hub was closed.
        """
        if self._closed:
            raise RuntimeError("the event hub is closed")
        self._running_loop()
        missed = self._missed_since(last_seq, epoch)
        snapshot = self.snapshot() if missed is None else None
        sub = Subscription(self._remove, self.queue_size, snapshot, missed or [])
        self._subs.add(sub)
        return sub

    def _missed_since(self, last_seq: int | None, epoch: str | None) -> list[Published] | None:
        if last_seq is None or last_seq < 0 or last_seq > self.seq:
            return None
        if epoch is not None and epoch != self.epoch:
            return None
        if last_seq == self.seq:
            return []
        if not self._buffer or self._buffer[0].event.seq > last_seq + 1:
            return None  # some of what it missed is gone
        return [p for p in self._buffer if p.event.seq > last_seq]

    def unsubscribe(self, sub: Subscription) -> None:
        """Remove ``sub`` (idempotent)."""
        self._remove(sub, CLOSE_NORMAL, "unsubscribed")

    def _remove(self, sub: Subscription, code: int, reason: str) -> None:
        self._subs.discard(sub)
        if not sub.closed:
            sub.end(code, reason)

    def close(self, code: int = CLOSE_GOING_AWAY, reason: str = "the service is stopping") -> None:
        """Close every subscription with ``code`` and refuse new ones."""
        self._closed = True
        self._cancel_vram_timer()
        for sub in list(self._subs):
            self._remove(sub, code, reason)

    def subscribers(self) -> Iterable[Subscription]:
        return tuple(self._subs)
