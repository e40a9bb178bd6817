"""What the supervisor does with an engine event: one log line, the service's record of
it (``on_engine_event``), and the engine's limits after it.

The worker reports ``OomEvent`` (a step ran out of memory), ``ReplanWanted`` (the
prefill chunk cap shrank) and ``Replanned`` (the KV pool changed size); the last two
change what ``/v1/models`` and the context check read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from engine.wire.messages import OOM_FAILED, EngineEvent, EngineInfo, OomEvent, Replanned, ReplanWanted

log = logging.getLogger("headroom.supervisor")


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
        plan = info.plan
        if plan is not None and event.max_context_tokens != info.max_context_tokens:
            plan = plan.after_resize(max(event.after_pages - 1, 0), event.after_bytes, event.max_context_tokens,
                                     event.reason)
        return msgspec.structs.replace(
            info,
            plan=plan,
            num_pages=event.after_pages,
            kv_cache_bytes=event.after_bytes,
            max_context_tokens=event.max_context_tokens,
            max_prefill_tokens=event.max_prefill_tokens,
        )
    if isinstance(event, ReplanWanted):
        return msgspec.structs.replace(info, max_prefill_tokens=event.new_max_prefill_tokens)
    return info


def take_engine_event(
    event: EngineEvent,
    on_engine_event: Callable[[EngineEvent], None] | None,
    info: EngineInfo | None,
) -> EngineInfo | None:
    """Log ``event`` (:func:`log_engine_event`), hand it to ``on_engine_event`` (whose
    exception is logged, never raised) and return ``info`` after it (:func:`info_after`;
    None stays None)."""
    log_engine_event(event)
    if on_engine_event is not None:
        try:
            on_engine_event(event)
        except Exception:
            log.exception("could not record an engine event")
    return None if info is None else info_after(info, event)
