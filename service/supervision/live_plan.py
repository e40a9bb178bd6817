"""The plan in force while serving: the memory plan the service shows (``/api/status``'s
``plan``, ``plan`` events, ``EngineInfo.plan``) as live replans change it.

One function, :func:`plan_now`, gives the plan after each engine event, for the
supervisor's ``info`` and for the ``plan`` event alike, so the two never disagree. What
follows the live changes: the KV pool (``num_pages``, usable pages; ``kv_pool_bytes``,
their bytes, as the start's plan counts them; a sliding-window ring pool's usable pages
beside it, ``kv_ring_pages``),
the prefill chunk cap (``max_prefill_tokens``), the per-request context
(``max_context_tokens`` and ``context_note``, :meth:`MemoryPlan.after_resize`) and a
split's move (``cpu_layers``, ``split_note``, ``fixed_bytes``). What stays the start's:
the ``ledger``'s lines, ``budget_bytes`` and what the start's plan suggested; the
ledger is how the start's plan was made, the other figures what is in force now.
"""

from __future__ import annotations

import msgspec

from engine.memory.kv_fit import usable_pages
from engine.memory.plan import MemoryPlan
from engine.wire.messages import EngineEvent, EngineInfo, Replanned, ReplanWanted


def split_moved(plan: MemoryPlan | None, event: Replanned) -> MemoryPlan:
    """The plan shown after a split's move (``event.plan`` set): ``plan`` (the one shown
    now, its pool as live resizes left it) with the split, its note, the fixed bytes the
    engine's plan now charges and the pool's bytes now; the engine's plan where none
    is shown."""
    if plan is None:
        return event.plan
    moved = event.plan
    return msgspec.structs.replace(plan, cpu_layers=moved.cpu_layers, split_note=moved.split_note,
                                   fixed_bytes=moved.fixed_bytes, kv_pool_bytes=event.after_kv_pool_bytes)


def plan_now(info: EngineInfo, event: EngineEvent) -> MemoryPlan | None:
    """The plan in force after ``event`` (see the module docstring): ``info.plan`` (the
    one in force before it) with the figures ``event`` changed; None where no plan was
    made (a fixed pool size); ``info.plan`` itself for an event that changes none."""
    plan = info.plan
    if isinstance(event, ReplanWanted):
        if plan is None or plan.max_prefill_tokens == event.new_max_prefill_tokens:
            return plan
        return msgspec.structs.replace(plan, max_prefill_tokens=event.new_max_prefill_tokens)
    if not isinstance(event, Replanned):
        return plan
    if event.plan is not None:
        plan = split_moved(plan, event)
    if plan is None:
        return None
    usable = usable_pages(event.after_pages)
    if event.max_context_tokens != info.max_context_tokens:
        plan = plan.after_resize(usable, event.after_kv_pool_bytes, event.max_context_tokens, event.reason)
    now = {"num_pages": usable, "kv_pool_bytes": event.after_kv_pool_bytes, "max_prefill_tokens": event.max_prefill_tokens}
    if event.after_ring_pages:  # the sliding-window ring pool, resized with the KV pool
        now["kv_ring_pages"] = usable_pages(event.after_ring_pages)
    if all(getattr(plan, k) == v for k, v in now.items()):
        return plan
    return msgspec.structs.replace(plan, **now)
