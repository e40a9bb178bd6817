"""What the routes share: settings, the supervisor, the tokenizer side.

One :class:`Services` object per app, handed to route handlers by Litestar's
dependency injection (parameter name ``svc``), never through module globals.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from engine.wire.messages import (
    BY_CONTROL,
    OOM_FAILED,
    REPLAN_EVICT_PREFIX_CACHE,
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
from engine.common.units import SIZE_UNITS
from service.api.admission import Admission
from service.api.errors import APIError
from service.api.sampling_defaults import SamplingDefaults, load_sampling_defaults
from service.api.text import TextSide
from service.cli.settings import ServeSettings
from service.events.hub import EventHub
from service.events.schemas import (
    CountersEvent,
    PlanEvent,
    PlanPoint,
    ReplanEvent,
    RequestErrorEvent,
)
from service.supervision.supervisor import Supervisor

# The reason (for people) of a replan asked for through the control API (the service's
# own replans say which water mark was crossed); its ``origin`` is ``BY_CONTROL``, and
# ``replan`` events name those ``set_kv_cache`` and ``clear_prefix_cache``.
CONTROL_REASON = "asked for through the control API"

# "Tried to allocate 20.00 MiB" in torch's out-of-memory message.
_ASKED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")


def bytes_asked(message: str) -> int | None:
    """The failed allocation's size from torch's out-of-memory text, or None."""
    match = _ASKED.search(message)
    return None if match is None else int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


DEFAULT_MODEL_ALIAS = "default"


class EngineEventCounts(msgspec.Struct, kw_only=True):
    """Engine events since the service started, as the ``counters`` event carries them:
    out-of-memory steps (each rolled back), requests failed by them, and replans."""

    oom_steps: int = 0
    oom_failed_requests: int = 0
    replans: int = 0  # replan events: ReplanWanted and the engine's live Replanned changes


@dataclass
class Services:
    """The app's shared objects. ``text`` is set once a worker is ready and reloaded
    only when a restarted worker serves another model folder. ``started_at`` is the
    service's start, in Unix seconds (the ``created`` of ``/v1/models``).
    ``engine_events`` counts what the engine reported (the hub keeps the request errors
    and replans themselves, for ``/api/status``).
    ``events`` is the hub the engine's events and the counters are published to (None in
    unit tests: nothing is published). ``admission`` counts the requests waiting for the
    engine (``--max-queued-requests``, :mod:`service.api.admission`)."""

    settings: ServeSettings
    supervisor: Supervisor
    text: TextSide | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    started_at: int = field(default_factory=lambda: int(time.time()))
    engine_events: EngineEventCounts = field(default_factory=EngineEventCounts)
    events: EventHub | None = None
    admission: Admission = field(init=False)
    _last_counters: CountersEvent | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        limit = self.settings.max_queued_requests if self.settings is not None else 0
        self.admission = Admission(limit)

    def record_engine_event(self, event: EngineEvent) -> None:
        """Called by the supervisor for each engine event (already logged there, and
        before the supervisor's ``info`` takes a ``Replanned``'s new sizes): counts it
        and publishes a ``request_error`` (each out-of-memory step, with the action the
        engine took) or a ``replan`` event, then the counters."""
        counts = self.engine_events
        if isinstance(event, OomEvent):
            counts.oom_steps += 1
            self._publish(self._request_error(event))
            if event.action == OOM_FAILED:
                counts.oom_failed_requests += 1
        elif isinstance(event, ReplanWanted):
            counts.replans += 1
            self._publish(self._replan_wanted(event))
        elif isinstance(event, Replanned):
            counts.replans += 1
            self._publish(self._replanned(event))
            self._publish(self._plan_after(event))
        self.publish_counters()

    # -- events ------------------------------------------------------------------------

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
        counts = self.engine_events
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
            num_pages=max(info.num_pages - 1, 0),
            max_prefill_tokens=info.max_prefill_tokens,
            prefix_cache_pages=cached,
        )
        after = msgspec.structs.replace(before, max_prefill_tokens=event.new_max_prefill_tokens)
        return ReplanEvent(
            action="lower_chunk_cap", reason=event.reason, before=before, after=after
        )

    def _plan_after(self, event: Replanned) -> PlanEvent | None:
        """A ``plan`` event when a resize changed the per-request context (the pool
        grew back after fit-the-card lowered it, or shrank below it): the plan with the
        new pool and context, its note saying so."""
        info = self.supervisor.info if self.supervisor is not None else None
        if info is None or info.plan is None or event.max_context_tokens == info.max_context_tokens:
            return None
        plan = info.plan.after_resize(max(event.after_pages - 1, 0), event.after_bytes, event.max_context_tokens,
                                      event.reason)
        return PlanEvent(plan=plan)

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
        else:
            action = event.action
        before = PlanPoint(
            kv_pool_bytes=event.before_bytes,
            num_pages=max(event.before_pages - 1, 0),
            max_prefill_tokens=chunk_before,
            prefix_cache_pages=cached,
            **_expert_cache(event.before_expert_slots, event.before_expert_bytes, event),
        )
        after = PlanPoint(
            kv_pool_bytes=event.after_bytes,
            num_pages=max(event.after_pages - 1, 0),
            max_prefill_tokens=event.max_prefill_tokens,
            prefix_cache_pages=cached_after,
            **_expert_cache(event.after_expert_slots, event.after_expert_bytes, event),
        )
        details = []
        if event.evicted_pages and event.action != REPLAN_EVICT_PREFIX_CACHE:
            details.append(f"{event.evicted_pages} prefix-cache pages evicted")
        if event.relocated_pages:
            details.append(f"{event.relocated_pages} pages moved")
        if event.preempted:
            details.append(f"{len(event.preempted)} requests preempted (they are recomputed)")
        if event.ended:
            details.append(f"{len(event.ended)} requests ended (no longer fit the context)")
        reason = event.reason + (f" ({'; '.join(details)})" if details else "")
        return ReplanEvent(
            action=action,
            reason=reason,
            before=before,
            after=after,
            duration_s=event.duration_ms / 1000,
        )

    def model_names(self, info: EngineInfo) -> list[str]:
        """Names the served model answers to: the engine's, the store name ``--model``
        gave (``owner/name[:FILE.gguf]``, when it is not a path), the configured aliases,
        then ``default`` (each once)."""
        names = [info.model_name]
        model = self.settings.model
        if model and model != info.model_name and not Path(model).expanduser().exists():
            names.append(model)
        names += [*self.settings.served_model_name, DEFAULT_MODEL_ALIAS]
        return list(dict.fromkeys(names))

    def check_model(self, requested: str | None, info: EngineInfo) -> str:
        """The model name to report for a request naming ``requested``.

        An absent or empty name, or ``"default"``, means the served model (there is
        only one).

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        names = self.model_names(info)
        # "default" always names the one served model: the README's and most clients'
        # first request, before anyone has read /v1/models.
        if not requested or requested in names:
            return names[0]
        raise APIError(
            404,
            f"The model `{requested}` does not exist; this server serves "
            + ", ".join(f"`{n}`" for n in names),
            param="model",
            code="model_not_found",
        )

    async def prepare(self, info: EngineInfo) -> None:
        """Called by the supervisor when a worker is ready: load its tokenizer and its
        sampling defaults (:mod:`service.api.sampling_defaults`)."""
        if self.text is None or self.text.model_dir != info.model_dir:
            old, self.text = self.text, await TextSide.load(info.model_dir)
            self.sampling_defaults = await asyncio.to_thread(
                load_sampling_defaults, info.model_dir
            )
            if old is not None:
                old.close()


def _expert_cache(slots: int, nbytes: int, event: Replanned) -> dict[str, int]:
    """A :class:`PlanPoint`'s expert-cache fields from a ``Replanned``'s figures; none
    (left null) for an engine with every expert on the device."""
    has_cache = (event.before_expert_slots or event.after_expert_slots
                 or event.before_expert_bytes or event.after_expert_bytes)
    return {"expert_cache_slots": slots, "expert_cache_bytes": nbytes} if has_cache else {}
