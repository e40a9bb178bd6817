"""Engine events become hub events, without a server: ``Replanned`` (the pool, the
prefill chunk, the prefix cache, the GPU expert cache) becomes a ``replan`` event,
``OomEvent`` a ``request_error``, a context that changes with the pool a ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from pool_fakes import STATS
from service_harness import engine_info as info

from engine.common.units import GiB, MiB
from engine.memory.plan import MemoryPlan
from engine.wire.messages import (
    BY_CONTROL,
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_MOVE_LAYERS,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_EXPERT_CACHE,
    REPLAN_RESIZE_POOL,
    EngineInfo,
    EngineStats,
    OomEvent,
    Replanned,
    ReplanWanted,
)
from service.control.actions import CONTROL_REASON
from service.events.hub import EventHub
from service.supervision.engine_events_to_ui import EngineEventsToUI, bytes_asked


@dataclass
class StubLink:
    stats: EngineStats | None = STATS
    in_flight: int = 0


@dataclass
class StubSupervisor:
    info: EngineInfo | None = field(default_factory=info)
    link: StubLink = field(default_factory=StubLink)


def services_with_hub() -> tuple[EngineEventsToUI, EventHub]:
    hub = EventHub()
    return EngineEventsToUI(hub, StubSupervisor()), hub


def replanned(action: str, before: int, after: int, **kw: Any) -> Replanned:
    return Replanned(
        action=action,
        reason=kw.pop("reason", "headroom low"),
        before_pages=before,
        after_pages=after,
        before_bytes=before * MiB,
        after_bytes=after * MiB,
        before_kv_pool_bytes=(before - 1) * MiB,  # the usable pages, at a MiB each
        after_kv_pool_bytes=(after - 1) * MiB,
        duration_ms=12.0,
        max_prefill_tokens=kw.pop("chunk", 2048),
        max_context_tokens=2048,
        **kw,
    )


def test_engine_events_become_replan_and_request_error_events():
    svc, hub = services_with_hub()
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 101, 51, preempted=["x"]))
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 51, 101))
    svc.record_engine_event(
        replanned(REPLAN_RESIZE_POOL, 101, 41, reason=f"{CONTROL_REASON}: KV cache 40 MiB", origin=BY_CONTROL)
    )
    svc.record_engine_event(replanned(REPLAN_PREFILL_CHUNK, 41, 41, chunk=256))
    svc.record_engine_event(replanned(REPLAN_EVICT_PREFIX_CACHE, 41, 41, evicted_pages=5))
    svc.record_engine_event(
        replanned(REPLAN_EVICT_PREFIX_CACHE, 41, 41, reason=CONTROL_REASON, origin=BY_CONTROL)
    )
    svc.record_engine_event(ReplanWanted(reason="oom in a step", new_max_prefill_tokens=1024))
    svc.record_engine_event(
        OomEvent(
            request_id="r-0",
            phase="prefill",
            tokens_in_step=512,
            action="retry_smaller_chunk",
            message="CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0 ...)",
        )
    )
    snap = hub.snapshot()
    actions = [r.action for r in snap.replans]
    assert actions == [
        "shrink_kv",
        "grow_kv",
        "set_kv_cache",
        "lower_chunk_cap",
        "evict_prefix_cache",
        "clear_prefix_cache",
        "lower_chunk_cap",
    ]
    shrink = snap.replans[0]
    assert (shrink.before.num_pages, shrink.after.num_pages) == (100, 50)
    assert shrink.duration_s == pytest.approx(0.012)
    assert "1 request preempted" in shrink.reason
    evict = snap.replans[4]
    assert (evict.before.prefix_cache_pages, evict.after.prefix_cache_pages) == (7, 2)
    (error,) = snap.request_errors
    assert error.code == "out_of_memory" and error.action == "retry_smaller_chunk"
    assert error.bytes_asked == 20 * MiB
    assert snap.counters is not None and snap.counters.replans == 7
    assert snap.counters.oom_steps == 1 and snap.counters.engine == STATS
    # Counters go out only when they change.
    seq = hub.seq
    svc.publish_counters(STATS)
    assert hub.seq == seq


def test_a_context_that_grows_back_with_the_pool_publishes_a_plan():
    """Fit-the-card lowered the context to 1,024 tokens; the pool growing back to the
    full context publishes a ``plan`` whose note is gone, a shrink below it one whose
    note says so, and the supervisor's info carries the same plan."""
    from service.supervision.engine_events_to_ui import info_after

    plan = MemoryPlan(
        device="sim", simulated=True, ledger=[], budget_bytes=3 * GiB, fixed_bytes=GiB, kv_pool_bytes=64 * MiB,
        num_pages=64, page_size=16, max_context_tokens=1024, min_context_tokens=512, fits=True, shortfall_bytes=0,
        suggestions=[], max_prefill_tokens=2048, max_running_requests=8, wanted_context_tokens=2048,
        context_note="context 2,048 -> 1,024 tokens: 1.0 GiB held by other processes",
    )
    svc, hub = services_with_hub()
    svc.supervisor.info = info(max_context_tokens=1024, num_pages=64, plan=plan)
    grow = replanned(REPLAN_RESIZE_POOL, 65, 129, reason="headroom back")
    svc.record_engine_event(grow)
    published = hub.snapshot().plan
    assert published is not None and published.plan is not None
    assert published.plan.max_context_tokens == 2048 and published.plan.num_pages == 128
    assert published.plan.context_note == "" and not published.plan.context_lowered
    svc.supervisor.info = info_after(svc.supervisor.info, grow)
    assert svc.supervisor.info.plan == published.plan

    shrink = msgspec.structs.replace(replanned(REPLAN_RESIZE_POOL, 129, 49, reason="another app"),
                                     max_context_tokens=768)
    svc.record_engine_event(shrink)
    after = hub.snapshot().plan.plan
    assert after.max_context_tokens == 768 and after.context_note == "context 2,048 -> 768 tokens: another app"
    # A resize that leaves the context where it was publishes the plan with the pool now,
    # its context and note as they were.
    svc.supervisor.info = info_after(svc.supervisor.info, shrink)
    svc.record_engine_event(msgspec.structs.replace(replanned(REPLAN_RESIZE_POOL, 49, 50), max_context_tokens=768))
    # The pool's bytes are its usable pages', as the plan counts them (49 x 1 MiB).
    assert hub.snapshot().plan.plan == msgspec.structs.replace(after, num_pages=49, kv_pool_bytes=49 * MiB)


def test_the_plan_shown_is_the_plan_in_force():
    """The pool, the prefill chunk cap (the watcher's or the engine's own after an
    out-of-memory step) and the context follow every replan, in the ``plan`` event and
    in the supervisor's info alike; the ledger stays the start's."""
    from service.supervision.engine_events_to_ui import info_after

    plan = MemoryPlan(
        device="sim", simulated=True, ledger=[], budget_bytes=2 * GiB, fixed_bytes=GiB, kv_pool_bytes=512 * MiB,
        num_pages=512, page_size=16, max_context_tokens=2048, min_context_tokens=512, fits=True, shortfall_bytes=0,
        suggestions=[], max_prefill_tokens=2048, max_running_requests=8, wanted_context_tokens=2048,
    )
    svc, hub = services_with_hub()
    svc.supervisor.info = info(num_pages=512, plan=plan, max_prefill_tokens=2048)
    for event in (replanned(REPLAN_PREFILL_CHUNK, 513, 513, chunk=818), replanned(REPLAN_RESIZE_POOL, 513, 201,
                  chunk=818), ReplanWanted(reason="out of memory in a step", new_max_prefill_tokens=512)):
        svc.record_engine_event(event)
        svc.supervisor.info = info_after(svc.supervisor.info, event)
        shown = hub.snapshot().plan.plan
        assert shown == svc.supervisor.info.plan
        assert shown.max_prefill_tokens == svc.supervisor.info.max_prefill_tokens
        assert shown.kv_pool_bytes == svc.supervisor.info.kv_cache_bytes
        assert shown.num_pages == svc.supervisor.info.num_pages
    assert (shown.num_pages, shown.max_prefill_tokens, shown.ledger) == (200, 512, plan.ledger)


def test_bytes_asked_reads_torchs_message():
    assert bytes_asked("Tried to allocate 1.50 GiB") == int(1.5 * GiB)
    assert bytes_asked("tried to allocate 512 B") == 512
    assert bytes_asked("out of memory") is None


def test_expert_cache_resizes_become_replan_events_with_the_slots():
    svc, hub = services_with_hub()
    sizes = dict(before_expert_slots=48, before_expert_bytes=48 * 8 * MiB)
    svc.record_engine_event(replanned(REPLAN_RESIZE_EXPERT_CACHE, 101, 101, **sizes, after_expert_slots=10,
                                      after_expert_bytes=80 * MiB))
    svc.record_engine_event(replanned(REPLAN_RESIZE_EXPERT_CACHE, 101, 101, before_expert_slots=10,
                                      before_expert_bytes=80 * MiB, after_expert_slots=48,
                                      after_expert_bytes=48 * 8 * MiB))
    svc.record_engine_event(replanned(REPLAN_RESIZE_EXPERT_CACHE, 101, 101, **sizes, after_expert_slots=0,
                                      reason=f"{CONTROL_REASON}: expert cache 0 B", origin=BY_CONTROL))
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 101, 51))  # an engine without host experts
    shrink, grow, by_hand, pool = hub.snapshot().replans
    assert [r.action for r in (shrink, grow, by_hand)] == ["shrink_expert_cache", "grow_expert_cache",
                                                           "set_expert_cache"]
    assert (shrink.before.expert_cache_slots, shrink.after.expert_cache_slots) == (48, 10)
    assert (shrink.before.expert_cache_bytes, shrink.after.expert_cache_bytes) == (384 * MiB, 80 * MiB)
    assert shrink.before.num_pages == shrink.after.num_pages == 100, "the pool is untouched"
    assert by_hand.after.expert_cache_slots == 0
    assert pool.before.expert_cache_slots is None and pool.after.expert_cache_bytes is None


def test_split_moves_become_replan_events_and_a_plan_with_the_split_now():
    """A move of the split (``REPLAN_MOVE_LAYERS``) becomes ``move_layers_to_cpu`` /
    ``_to_device`` with the layers before and after, and publishes the plan shown now
    (its pool as live resizes left it) with the split, its note and fixed bytes."""
    from service.supervision.engine_events_to_ui import info_after

    shown = MemoryPlan(
        device="sim", simulated=True, ledger=[], budget_bytes=3 * GiB, fixed_bytes=GiB, kv_pool_bytes=30 * MiB,
        num_pages=30, page_size=16, max_context_tokens=2048, min_context_tokens=512, fits=True, shortfall_bytes=0,
        suggestions=[], max_prefill_tokens=256, max_running_requests=8, wanted_context_tokens=2048,
    )
    engines = msgspec.structs.replace(shown, num_pages=300, kv_pool_bytes=200 * MiB, fixed_bytes=GiB - 40 * MiB,
                                      cpu_layers=10, split_note="decoder layers 20-29 (10 of 30) run on the CPU")
    svc, hub = services_with_hub()
    svc.supervisor.info = info(num_pages=30, plan=shown)
    down = replanned(REPLAN_MOVE_LAYERS, 31, 31, before_cpu_layers=0, after_cpu_layers=10,
                     moved_bytes=50 * MiB, plan=engines)
    down = msgspec.structs.replace(down, after_kv_pool_bytes=20 * MiB)
    svc.record_engine_event(down)
    published = hub.snapshot().plan.plan
    assert (published.cpu_layers, published.split_note) == (10, engines.split_note)
    assert (published.num_pages, published.kv_pool_bytes, published.fixed_bytes) == (30, 20 * MiB, GiB - 40 * MiB)
    svc.supervisor.info = info_after(svc.supervisor.info, down)
    assert svc.supervisor.info.plan == published
    for event in (replanned(REPLAN_MOVE_LAYERS, 31, 31, before_cpu_layers=10, after_cpu_layers=0,
                            moved_bytes=-50 * MiB, plan=msgspec.structs.replace(shown)),
                  replanned(REPLAN_RESIZE_POOL, 31, 61)):
        svc.record_engine_event(event)  # as the supervisor does: then its info takes the event
        svc.supervisor.info = info_after(svc.supervisor.info, event)
    moved, back, pool = hub.snapshot().replans
    assert [r.action for r in (moved, back)] == ["move_layers_to_cpu", "move_layers_to_device"]
    assert (moved.before.cpu_layers, moved.after.cpu_layers) == (0, 10)
    assert "10 decoder layers moved, 50 MiB of device memory given back" in moved.reason
    assert "of device memory taken" in back.reason and back.after.cpu_layers == 0
    assert pool.before.cpu_layers is None, "an engine whose layers never moved shows none"
    assert hub.snapshot().plan.plan.cpu_layers == 0 and hub.snapshot().plan.plan.split_note == ""


def test_every_event_of_an_engine_whose_split_moves_names_its_layers_on_the_cpu():
    """After a move back to 0 layers on the CPU, a pool resize (which moves no layer)
    still says 0 before and after, from the live state, not null."""
    from pool_fakes import pool_stats

    svc, hub = services_with_hub()
    svc.supervisor.link.pool = msgspec.structs.replace(  # type: ignore[attr-defined]
        pool_stats(31, min_pages=9, activation_bytes_per_token=0, max_context_tokens=2048), max_cpu_layers=29)
    svc.record_engine_event(replanned(REPLAN_MOVE_LAYERS, 31, 31, before_cpu_layers=29, after_cpu_layers=0,
                                      reason=CONTROL_REASON, origin=BY_CONTROL))
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 31, 21))
    svc.record_engine_event(ReplanWanted(new_max_prefill_tokens=128, reason="out of memory"))
    moved, shrink, wanted = hub.snapshot().replans
    assert moved.action == "set_cpu_layers" and (moved.before.cpu_layers, moved.after.cpu_layers) == (29, 0)
    assert (shrink.before.cpu_layers, shrink.after.cpu_layers) == (0, 0)
    assert (wanted.before.cpu_layers, wanted.after.cpu_layers) == (0, 0)
