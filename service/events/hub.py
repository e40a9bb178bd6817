"""The event hub: typed events for the desktop app, fanned out to subscribers.

Everything the UI shows arrives as one of the event structs below, tagged by ``type``
in JSON: ``health``, ``worker``, ``engine``, ``vram``, ``plan``, ``replan``,
``request_error``, ``counters``. :meth:`EventHub.publish` stamps each with ``seq`` (monotonic from 1, per
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
emptied, and its next :meth:`Subscription.get` raises :class:`SubscriptionClosed` with
code :data:`CLOSE_TOO_SLOW` (4008), the close code the WebSocket then carries.

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
from typing import Any, Literal, NamedTuple

import msgspec

from engine.memory.plan import MemoryPlan
from engine.messages import EngineInfo, EngineStats, OomEvent
from engine.units import fmt_bytes

log = logging.getLogger("headroom.events")

MiB = 1 << 20

# WebSocket close codes of /api/events (4000-4999 are the application's own).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the service is shutting down
CLOSE_UNAUTHORIZED = 4001  # no token, or a wrong one: reconnecting will not help
CLOSE_ORIGIN_REFUSED = 4003  # the page's Origin is not on the allow-list
CLOSE_TOO_SLOW = 4008  # the client read too slowly; its queue overflowed

DEFAULT_BUFFER_SIZE = 1024  # events kept for resume
DEFAULT_QUEUE_SIZE = 256  # events waiting per subscriber before it is dropped
DEFAULT_KEEP_REQUEST_ERRORS = 50  # request errors in a snapshot
DEFAULT_KEEP_REPLANS = 20  # replans in a snapshot

HealthStatus = Literal["starting", "ready", "restarting", "failed", "stopped"]
WorkerPhase = Literal["started", "exited", "restarting", "failed"]
VramSource = Literal["nvml", "simulated", "none"]


# -- events -------------------------------------------------------------------------------


class EventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Fields of every event. ``seq`` and ``ts`` are set by :meth:`EventHub.publish`
    (leave them 0); ``seq`` counts from 1 per hub (see ``Snapshot.epoch``), ``ts`` is
    Unix seconds."""

    seq: int = 0
    ts: float = 0.0


class HealthEvent(EventBase, frozen=True, kw_only=True, tag="health"):
    """The service's readiness, as ``/api/health`` reports it.

    ``status``: ``ready`` only while a worker serves. ``reason`` says why for
    ``failed``; ``retry_after_s`` is the expected wait (whole seconds) while starting or
    restarting. ``model`` is the served model's name once one was loaded.
    """

    status: HealthStatus
    model: str | None = None
    reason: str | None = None
    retry_after_s: int | None = None
    worker_pid: int | None = None
    restarts: int = 0

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> HealthEvent:
        """From ``Supervisor.health()``'s dict (``status``, ``model``, ``reason``,
        ``retry_after_s``, ``worker_pid``, ``restarts``; other keys are ignored)."""
        return cls(
            status=report["status"],
            model=report.get("model"),
            reason=report.get("reason"),
            retry_after_s=report.get("retry_after_s"),
            worker_pid=report.get("worker_pid"),
            restarts=int(report.get("restarts", 0)),
        )


class WorkerEvent(EventBase, frozen=True, kw_only=True, tag="worker"):
    """A change in the engine worker process's life.

    ``started``: spawned, ``pid`` set. ``exited``: ended; ``exit_code`` (None when
    killed by a signal), ``signal`` (its name, e.g. ``"SIGKILL"``, or None), ``reason``
    (e.g. ``"was killed by SIGKILL"``) and its ``last_lines`` of output. ``restarting``: a new worker follows in ``delay_s``
    seconds. ``failed``: no more restarts (``reason`` says why) until one is asked for.
    ``restarts`` counts restarts since the service started.
    """

    phase: WorkerPhase
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    delay_s: float | None = None
    restarts: int = 0
    last_lines: list[str] = []


class EngineInfoEvent(EventBase, frozen=True, kw_only=True, tag="engine"):
    """Facts about the engine a worker loaded (model, device, dtype, context, KV pages),
    sent when a worker becomes ready. Publish it with ``info.plan`` set to None: the
    plan travels in ``plan`` events."""

    info: EngineInfo


class Consumer(msgspec.Struct, frozen=True):
    """A process holding device memory: ``pid``, process ``name``, ``bytes``."""

    pid: int
    name: str
    bytes: int


class VramEvent(EventBase, frozen=True, kw_only=True, tag="vram"):
    """The device's memory now, in bytes.

    ``ours_bytes`` is held by this service's processes, ``others_bytes`` by everyone
    else; ``free_bytes`` is what the device has free; ``reserve_bytes`` is kept for the
    desktop; ``headroom_bytes = free_bytes - reserve_bytes`` (negative when the desktop
    is already short). ``source`` is ``nvml``, ``simulated``, or ``none`` (no GPU: CPU
    mode, all sizes 0, ``reason`` says why). ``top_consumers`` lists the largest other
    processes.

    ``device_limit_bytes`` is ``--device-limit`` where it is smaller than the card, and
    ``memory_rule`` says for people which rule reads the card (the same one the memory
    plan used at start): a card of the limit's size, against which other processes'
    memory counts, or the whole card.
    """

    device: str
    source: VramSource
    total_bytes: int
    free_bytes: int
    ours_bytes: int
    others_bytes: int
    reserve_bytes: int
    headroom_bytes: int
    top_consumers: list[Consumer] = []
    reason: str | None = None
    device_limit_bytes: int | None = None
    memory_rule: str | None = None

    @classmethod
    def from_sample(
        cls, sample: Any, reserve_bytes: int, *, source: VramSource = "nvml"
    ) -> VramEvent:
        """From the watcher's sample (``service.vram.sources.VramSample`` or anything with its
        fields: ``gpu``, ``device``, ``total_bytes``, ``free_bytes``, ``ours_bytes``,
        ``others_bytes``, ``top_consumers`` of ``pid``/``name``/``bytes``, ``reason``).
        A sample with ``gpu`` False becomes ``source="none"`` (CPU mode)."""
        gpu = bool(getattr(sample, "gpu", True))
        free = int(sample.free_bytes)
        return cls(
            device=str(getattr(sample, "device", "") or ("no GPU" if not gpu else "GPU")),
            source=source if gpu else "none",
            total_bytes=int(sample.total_bytes),
            free_bytes=free,
            ours_bytes=int(sample.ours_bytes),
            others_bytes=int(sample.others_bytes),
            reserve_bytes=int(reserve_bytes),
            headroom_bytes=free - int(reserve_bytes),
            top_consumers=[
                Consumer(int(p.pid), str(p.name), int(p.bytes))
                for p in getattr(sample, "top_consumers", ())
            ],
            reason=getattr(sample, "reason", None) or None,
            device_limit_bytes=getattr(sample, "device_limit_bytes", None),
            memory_rule=memory_rule(getattr(sample, "device_limit_bytes", None)) if gpu else None,
        )


def memory_rule(device_limit_bytes: int | None) -> str:
    """The rule by which the plan, the watcher and the replan controller read the card."""
    if device_limit_bytes is None:
        return "the whole card; other processes' memory counts against it"
    return (
        f"a card of {fmt_bytes(device_limit_bytes)} (--device-limit): other processes' "
        f"memory counts against it, as on a real card of that size"
    )


class PlanEvent(EventBase, frozen=True, kw_only=True, tag="plan"):
    """The worker's memory plan (the ledger of every byte); ``plan`` is null when the
    KV cache size was fixed by a flag and no plan was made."""

    plan: MemoryPlan | None


class PlanPoint(msgspec.Struct, frozen=True, kw_only=True):
    """The sizes a replan moves: the KV pool (bytes and usable pages), the prefill
    chunk cap (tokens) and the prefix cache's pages (None when unknown)."""

    kv_pool_bytes: int
    num_pages: int
    max_prefill_tokens: int
    prefix_cache_pages: int | None = None


class ReplanEvent(EventBase, frozen=True, kw_only=True, tag="replan"):
    """The plan changed while serving. ``action`` names the step (e.g.
    ``lower_chunk_cap``, ``evict_prefix_cache``, ``shrink_kv``, ``grow_kv``,
    ``set_kv_cache``); ``reason`` says why for people; ``duration_s`` how long it took.
    """

    action: str
    reason: str
    before: PlanPoint
    after: PlanPoint
    duration_s: float | None = None


class RequestErrorEvent(EventBase, frozen=True, kw_only=True, tag="request_error"):
    """A request hit an error inside the engine (the engine stayed up).

    ``code`` e.g. ``out_of_memory``; ``phase`` where (``prefill``, ``decode``,
    ``sample``); ``action`` what was done (``failed``, ``retry_smaller_chunk``,
    ``preempted``, ``retry``); ``bytes_asked`` the failed allocation's size and
    ``headroom_bytes`` the device's headroom at the time, when known.
    """

    request_id: str
    code: str
    message: str
    action: str
    phase: str | None = None
    bytes_asked: int | None = None
    headroom_bytes: int | None = None

    @classmethod
    def from_oom(
        cls,
        event: OomEvent,
        *,
        bytes_asked: int | None = None,
        headroom_bytes: int | None = None,
    ) -> RequestErrorEvent:
        """From the engine's :class:`engine.messages.OomEvent`."""
        return cls(
            request_id=event.request_id,
            code="out_of_memory",
            message=event.message,
            action=event.action,
            phase=event.phase,
            bytes_asked=bytes_asked,
            headroom_bytes=headroom_bytes,
        )


class CountersEvent(EventBase, frozen=True, kw_only=True, tag="counters"):
    """Counters: the engine's (``engine``, null when no worker answers) and the
    service's: sequences in flight, out-of-memory steps (each rolled back), requests
    they failed, replans."""

    engine: EngineStats | None = None
    in_flight: int = 0
    oom_steps: int = 0
    oom_failed_requests: int = 0
    replans: int = 0


Event = (
    HealthEvent
    | WorkerEvent
    | EngineInfoEvent
    | VramEvent
    | PlanEvent
    | ReplanEvent
    | RequestErrorEvent
    | CountersEvent
)
EVENT_TYPES: tuple[type[EventBase], ...] = (
    HealthEvent,
    WorkerEvent,
    EngineInfoEvent,
    VramEvent,
    PlanEvent,
    ReplanEvent,
    RequestErrorEvent,
    CountersEvent,
)


class Snapshot(EventBase, frozen=True, kw_only=True, tag="snapshot"):
    """Everything the UI shows, at ``seq`` (the last event it includes; the next event
    has ``seq + 1``). ``epoch`` names this hub (a new one per service start): resume
    only with the epoch the ``seq`` came from. Each field holds the latest event of its
    kind (null before the first), ``last_exit`` the latest ``worker`` event of phase
    ``exited`` (code, signal, reason survive the restart); ``request_errors`` and
    ``replans`` the newest ones, oldest first. This is also the body of
    ``GET /api/status``."""

    epoch: str
    health: HealthEvent | None = None
    worker: WorkerEvent | None = None
    last_exit: WorkerEvent | None = None
    engine: EngineInfoEvent | None = None
    plan: PlanEvent | None = None
    vram: VramEvent | None = None
    counters: CountersEvent | None = None
    request_errors: list[RequestErrorEvent] = []
    replans: list[ReplanEvent] = []


ServerMessage = Snapshot | Event
"""Every text frame ``/api/events`` sends is one of these, as JSON."""

_encoder = msgspec.json.Encoder()
message_decoder = msgspec.json.Decoder(ServerMessage)


def encode(message: ServerMessage) -> str:
    """A message as the JSON text of one WebSocket frame."""
    return _encoder.encode(message).decode()


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
        return any(
            abs(a - b) >= self.threshold_bytes
            for a, b in (
                (old.total_bytes, new.total_bytes),
                (old.free_bytes, new.free_bytes),
                (old.ours_bytes, new.ours_bytes),
                (old.others_bytes, new.others_bytes),
                (old.reserve_bytes, new.reserve_bytes),
                (old.headroom_bytes, new.headroom_bytes),
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


# -- subscriptions ----------------------------------------------------------------------------


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
    """One subscriber's view of the hub; made by :meth:`EventHub.subscribe`.

    Attributes:
        snapshot: the state to start from, or None when resuming (then ``missed``
            holds the events after ``last_seq``, in order, possibly none).
        missed: events to apply before those from :meth:`get`.
        close_code / close_reason: set once closed.
    """

    def __init__(
        self,
        hub: EventHub,
        queue_size: int,
        snapshot: Snapshot | None,
        missed: list[Published],
    ) -> None:
        self._hub = hub
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
        self._hub._remove(self, code, reason)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # hub side
    def _offer(self, item: Published) -> bool:
        if self._queue.qsize() >= self._limit:
            return False
        self._queue.put_nowait(item)
        return True

    def _end(self, code: int, reason: str) -> None:
        self.close_code, self.close_reason = code, reason
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_CLOSED)
        self.closed_event.set()


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
        slow = [sub for sub in self._subs if not sub._offer(item)]
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
        sub = Subscription(self, self.queue_size, snapshot, missed or [])
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
            sub._end(code, reason)

    def close(self, code: int = CLOSE_GOING_AWAY, reason: str = "the service is stopping") -> None:
        """Close every subscription with ``code`` and refuse new ones."""
        self._closed = True
        self._cancel_vram_timer()
        for sub in list(self._subs):
            self._remove(sub, code, reason)

    def subscribers(self) -> Iterable[Subscription]:
        return tuple(self._subs)
