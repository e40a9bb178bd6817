"""Where the engine's events become the service's: the one place an
:class:`engine.wire.messages.EngineEvent` is logged, counted, turned into the events the
UI reads (:mod:`service.events.schemas`) and applied to the supervisor's
:class:`EngineInfo`.

The worker reports ``OomEvent`` (a step ran out of memory, and what the engine did),
``ReplanWanted`` (the prefill chunk cap shrank) and ``Replanned`` (the KV pool, the
prefill chunk, the prefix cache or the expert cache changed size). Here:

- :func:`log_engine_event` writes each in one line;
- :class:`EngineEventsToUI` counts them (:class:`EngineEventCounts`) and publishes to the
  hub a ``request_error`` (each out-of-memory step, with the failed allocation's size and
  the headroom then), a ``replan`` (before and after, as :class:`PlanPoint`), a ``plan``
  when a replan changed the plan in force, and the ``counters``;
- :func:`info_after` gives the limits a replan changed, the plan in force among them
  (:mod:`service.supervision.live_plan`) (``/v1/models`` and the context
  check read them), which the supervisor keeps;
- :func:`take_engine_event` is the supervisor's one call doing the three.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec

from engine.common.units import SIZE_UNITS, count_of, fmt_bytes
from engine.memory.kv_fit import usable_pages
from engine.wire.messages import (
    BY_CONTROL,
    OOM_FAILED,
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_MOVE_LAYERS,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_EXPERT_CACHE,
    REPLAN_RESIZE_POOL,
    EngineEvent,
    EngineInfo,
    EngineStats,
    OomEvent,
    Replanned,
    ReplanWanted,
)
from service.events.hub import EventHub
from service.events.schemas import (
    CountersEvent,
    PlanEvent,
    PlanPoint,
    ReplanEvent,
    RequestErrorEvent,
)
from service.supervision.live_plan import plan_now, split_moved

log = logging.getLogger("headroom.supervisor")

# "Tried to allocate 20.00 MiB" in torch's out-of-memory message.
_ASKED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")


def bytes_asked(message: str) -> int | None:
    """The failed allocation's size from torch's out-of-memory text, or None."""
    match = _ASKED.search(message)
    return None if match is None else int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def log_engine_event(event: EngineEvent) -> None:
    """Log ``event`` in one line (errors for a failed OOM recovery, else warnings)."""
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


def info_after(info: EngineInfo, event: EngineEvent) -> EngineInfo:
    """``info`` with the limits ``event`` changed; ``info`` itself (the same object)
    when it changed none."""
    if isinstance(event, Replanned):
        return msgspec.structs.replace(
            info,
            plan=plan_now(info, event),
            num_pages=usable_pages(event.after_pages),
            kv_cache_bytes=event.after_kv_pool_bytes,
            kv_buffer_bytes=event.after_bytes,
            max_context_tokens=event.max_context_tokens,
            max_prefill_tokens=event.max_prefill_tokens,
        )
    if isinstance(event, ReplanWanted):
        return msgspec.structs.replace(info, plan=plan_now(info, event), max_prefill_tokens=event.new_max_prefill_tokens)
    return info


def take_engine_event(
    event: EngineEvent,
    on_engine_event: Callable[[EngineEvent], None] | None,
    info: EngineInfo | None,
) -> EngineInfo | None:
    """What the supervisor does with each engine event: log it (:func:`log_engine_event`),
    hand it to ``on_engine_event`` (:meth:`EngineEventsToUI.record_engine_event` in the
    app; its exception is logged, never raised) and return ``info`` after it
    (:func:`info_after`; None stays None)."""
    log_engine_event(event)
    if on_engine_event is not None:
        try:
            on_engine_event(event)
        except Exception:
            log.exception("could not record an engine event")
    return None if info is None else info_after(info, event)


class EngineEventCounts(msgspec.Struct, kw_only=True):
    """Engine events since the service started, as the ``counters`` event carries them:
    out-of-memory steps (each rolled back), requests failed by them, and replans."""

    oom_steps: int = 0
    oom_failed_requests: int = 0
    replans: int = 0  # replan events: ReplanWanted and the engine's live Replanned changes


class EngineEventsToUI:
    """Turns the engine's events and counters into hub events.

    Args:
        events: the hub to publish to (None: nothing is published, the counts still
            are kept).
        supervisor: what knows the engine's state: ``info`` (:class:`EngineInfo` or
            None, read *before* it takes a ``Replanned``'s new sizes) and ``link``
            (``stats``: the last :class:`EngineStats`, ``in_flight``); None in tests.

    Attributes:
        counts: the engine events since the service started.
    """

    def __init__(self, events: EventHub | None, supervisor: Any) -> None:
        self.events = events
        self.supervisor = supervisor
        self.counts = EngineEventCounts()
        self._last_counters: CountersEvent | None = None

    def record_engine_event(self, event: EngineEvent) -> None:
        """Called by the supervisor for each engine event (already logged there, and
        before the supervisor's ``info`` takes a ``Replanned``'s new sizes): counts it
        and publishes a ``request_error`` (each out-of-memory step, with the action the
        engine took) or a ``replan`` event, then the counters."""
        counts = self.counts
        if isinstance(event, OomEvent):
            counts.oom_steps += 1
            self._publish(self._request_error(event))
            if event.action == OOM_FAILED:
                counts.oom_failed_requests += 1
        elif isinstance(event, ReplanWanted):
            counts.replans += 1
            self._publish(self._replan_wanted(event))
            self._publish(self._plan_after(event))
        elif isinstance(event, Replanned):
            counts.replans += 1
            self._publish(self._replanned(event))
            self._publish(self._plan_after(event))
        self.publish_counters()

    def _publish(self, event: object | None) -> None:
        if self.events is not None and event is not None:
            self.events.publish(event)  # type: ignore[arg-type]

    def publish_counters(self, stats: EngineStats | None = None) -> None:
        """Publish a ``counters`` event when anything in it changed since the last one
        (``stats``: the engine's counters just read; default the supervisor's last)."""
        if self.events is None:
            return
        supervisor = self.supervisor
        if stats is None and supervisor is not None:
            stats = supervisor.link.stats
        counts = self.counts
        event = CountersEvent(
            engine=stats,
            in_flight=supervisor.link.in_flight if supervisor is not None else 0,
            oom_steps=counts.oom_steps,
            oom_failed_requests=counts.oom_failed_requests,
            replans=counts.replans,
        )
        if event != self._last_counters:
            self._last_counters = event
            self.events.publish(event)

    def _headroom_now(self) -> int | None:
        if self.events is None:
            return None
        vram = self.events.snapshot().vram
        return None if vram is None or vram.source == "none" else vram.headroom_bytes

    def _request_error(self, event: OomEvent) -> RequestErrorEvent | None:
        if self.events is None:
            return None
        return RequestErrorEvent.from_oom(
            event, bytes_asked=bytes_asked(event.message), headroom_bytes=self._headroom_now()
        )

    def _cached_pages(self) -> int | None:
        stats = self.supervisor.link.stats if self.supervisor is not None else None
        return None if stats is None else stats.cached_pages

    def _replan_wanted(self, event: ReplanWanted) -> ReplanEvent | None:
        info = self.supervisor.info if self.supervisor is not None else None
        if self.events is None or info is None:
            return None
        cached = self._cached_pages()
        before = PlanPoint(
            kv_pool_bytes=info.kv_cache_bytes,
            num_pages=info.num_pages,
            max_prefill_tokens=info.max_prefill_tokens,
            prefix_cache_pages=cached,
            **self._split(0),
        )
        after = msgspec.structs.replace(before, max_prefill_tokens=event.new_max_prefill_tokens)
        return ReplanEvent(
            action="lower_chunk_cap", reason=event.reason, before=before, after=after
        )

    def _plan_after(self, event: EngineEvent) -> PlanEvent | None:
        """A ``plan`` event when ``event`` changed the plan in force
        (:func:`service.supervision.live_plan.plan_now`: the pool, the prefill chunk, the
        context, the split); the supervisor's ``info`` then carries the same plan."""
        info = self.supervisor.info if self.supervisor is not None else None
        if isinstance(event, Replanned) and event.plan is not None and (info is None or info.plan is None):
            return PlanEvent(plan=split_moved(None, event))
        if info is None or info.plan is None:
            return None
        plan = plan_now(info, event)
        return None if plan is info.plan else PlanEvent(plan=plan)

    def _split(self, cpu_layers: int, event: Replanned | None = None) -> dict[str, int]:
        """A :class:`PlanPoint`'s ``cpu_layers``: the live count (``event``'s, else the
        worker's last pool stats) on every event of an engine whose split can move or
        is split now; none (left null) for one that runs every layer on the device
        throughout."""
        link = self.supervisor.link if self.supervisor is not None else None
        pool = getattr(link, "pool", None)
        if event is None:
            if pool is None or not (pool.max_cpu_layers or pool.cpu_layers):
                return {}
            return {"cpu_layers": pool.cpu_layers}
        moves = pool is not None and pool.max_cpu_layers > 0
        return {"cpu_layers": cpu_layers} if moves or event.before_cpu_layers or event.after_cpu_layers else {}

    def _replanned(self, event: Replanned) -> ReplanEvent | None:
        info = self.supervisor.info if self.supervisor is not None else None
        if self.events is None:
            return None
        by_control = event.origin == BY_CONTROL
        chunk_before = info.max_prefill_tokens if info is not None else event.max_prefill_tokens
        cached = self._cached_pages()
        cached_after = None
        if event.action == REPLAN_RESIZE_POOL:
            if by_control:
                action = "set_kv_cache"
            else:
                action = "shrink_kv" if event.after_pages < event.before_pages else "grow_kv"
        elif event.action == REPLAN_PREFILL_CHUNK:
            lower = event.max_prefill_tokens < chunk_before
            action = "lower_chunk_cap" if lower else "raise_chunk_cap"
            cached_after = cached
        elif event.action == REPLAN_EVICT_PREFIX_CACHE:
            action = "clear_prefix_cache" if by_control else "evict_prefix_cache"
            cached_after = None if cached is None else max(cached - event.evicted_pages, 0)
        elif event.action == REPLAN_RESIZE_EXPERT_CACHE:
            if by_control:
                action = "set_expert_cache"
            else:
                action = "shrink_expert_cache" if event.after_expert_slots < event.before_expert_slots else "grow_expert_cache"
            cached_after = cached
        elif event.action == REPLAN_MOVE_LAYERS:
            down = event.after_cpu_layers > event.before_cpu_layers
            action = "set_cpu_layers" if by_control else "move_layers_to_cpu" if down else "move_layers_to_device"
            cached_after = cached
        else:
            action = event.action
        before = PlanPoint(
            kv_pool_bytes=event.before_kv_pool_bytes,
            num_pages=usable_pages(event.before_pages),
            max_prefill_tokens=chunk_before,
            prefix_cache_pages=cached,
            **_expert_cache(event.before_expert_slots, event.before_expert_bytes, event),
            **self._split(event.before_cpu_layers, event),
        )
        after = PlanPoint(
            kv_pool_bytes=event.after_kv_pool_bytes,
            num_pages=usable_pages(event.after_pages),
            max_prefill_tokens=event.max_prefill_tokens,
            prefix_cache_pages=cached_after,
            **_expert_cache(event.after_expert_slots, event.after_expert_bytes, event),
            **self._split(event.after_cpu_layers, event),
        )
        details = []
        if event.evicted_pages and event.action != REPLAN_EVICT_PREFIX_CACHE:
            details.append(f"{event.evicted_pages} prefix-cache pages evicted")
        if event.action == REPLAN_MOVE_LAYERS:
            details.append(f"{abs(event.after_cpu_layers - event.before_cpu_layers)} decoder layers moved, "
                           f"{fmt_bytes(abs(event.moved_bytes))} of device memory "
                           + ("given back" if event.moved_bytes >= 0 else "taken"))
        if event.relocated_pages:
            details.append(f"{event.relocated_pages} pages moved")
        if event.preempted:
            details.append(f"{count_of(len(event.preempted), 'request')} preempted (they are recomputed)")
        if event.ended:
            details.append(f"{count_of(len(event.ended), 'request')} ended (no longer fit the context)")
        reason = event.reason + (f" ({'; '.join(details)})" if details else "")
        return ReplanEvent(
            action=action,
            reason=reason,
            before=before,
            after=after,
            duration_s=event.duration_ms / 1000,
        )


def _expert_cache(slots: int, nbytes: int, event: Replanned) -> dict[str, int]:
    """A :class:`PlanPoint`'s expert-cache fields from a ``Replanned``'s figures; none
    (left null) for an engine with every expert on the device."""
    has_cache = (event.before_expert_slots or event.after_expert_slots
                 or event.before_expert_bytes or event.after_expert_bytes)
    return {"expert_cache_slots": slots, "expert_cache_bytes": nbytes} if has_cache else {}
