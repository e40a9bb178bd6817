"""The sliding-window ring pool follows a live KV pool resize
(:class:`engine.memory.kv_fit.RingRule`, ``Engine.resize_kv_pool``,
:func:`engine.scheduler.resize.shrink_rings`): the rule is the plan's over the least room
that holds the pages, the start's at the start's pages; a tiny Gemma 3 on a simulated
card is shrunk and grown mid-run, its ring pool at the rule's size each time, the bytes
freed the plan's for both pools, and its greedy ids transformers'; a shrink below the
pages the rings hold preempts; the service's controller counts both pools."""

from __future__ import annotations

import pytest
from model_checks import VOCAB, greedy_params, hf_greedy, seeded_prompts

from engine.memory.kv_fit import (
    RingRule,
    kv_pages,
    pages_freeing,
    pages_within,
    pool_cost,
    ring_pool_cap,
)
from engine.wire.messages import GenerateRequest

pytest.importorskip("transformers")


def _plan_split(room: int, pb: int, rp: int, full: int, floor: int, wanted: int) -> tuple[int, int]:
    """The start's plan over ``room``: (KV pool pages, ring pool pages)."""
    cap = ring_pool_cap(room, pb, rp, full, floor, wanted)
    pages = kv_pages(room, pb, rp, cap)
    return pages, min(pages, cap)


def test_the_rule_is_the_plans_over_the_least_room_that_holds_the_pages():
    """10-byte pages, 3-byte ring pages, a bound of 30, a floor of 8, a wanted context of
    40 pages: for plans over many rooms, the ring pool beside every size is what the plan
    gives over the least room holding that many pages, and the start's at the start's
    pages (where the room held the context and part of the bound)."""
    pb, rp, full, floor, wanted = 10, 3, 30, 8, 40
    least = {}
    room = 0
    for pages in range(1, 80):
        while _plan_split(room, pb, rp, full, floor, wanted)[0] < pages:
            room += 1
        least[pages] = _plan_split(room, pb, rp, full, floor, wanted)[1]
    plateau = 0
    for start_room in range(40, 1200, 37):
        p0, r0 = _plan_split(start_room, pb, rp, full, floor, wanted)
        plateau += floor < r0 < full
        rule = RingRule(ring_page_bytes=rp, full_cap=full, floor_cap=floor, wanted_pages=wanted, planned_pages=p0,
                        planned_rings=r0)
        assert [rule.rings(p) for p in least] == [r0 if p == p0 else least[p] for p in least]
    assert plateau >= 2  # starts between the floor and the bound were among them
    # Without a plan: the rings' bound beside the pages, as at start.
    free = RingRule(ring_page_bytes=rp, full_cap=full, floor_cap=floor, wanted_pages=0, planned_pages=50,
                    planned_rings=30)
    assert [free.rings(p) for p in (1, 20, 30, 60)] == [1, 20, 30, 30]


def test_pool_cost_and_the_pages_a_shrink_or_grow_takes():
    """A shrink takes the fewest pages that free the bytes asked for, counting the ring
    pages that go with them; a grow the most that fit the spare bytes."""
    rule = RingRule(ring_page_bytes=3, full_cap=30, floor_cap=8, wanted_pages=40, planned_pages=60, planned_rings=30)
    cost = [pool_cost(p, 10, rule) for p in range(2, 62)]
    assert cost == sorted(cost) and pool_cost(61, 10, rule) - pool_cost(60, 10, rule) == 10
    assert pool_cost(42, 10, rule) - pool_cost(41, 10, rule) == 10 + 22 * 3  # past the context: the bound
    assert pages_freeing(61, 10, rule, 60, 2) == 55  # six pages: 60 bytes
    assert pages_freeing(61, 10, rule, 200, 2) == 41  # past the wanted context the rings go to the floor
    assert pages_freeing(61, 10, rule, 10**6, 5) == 5
    assert pages_within(41, 10, rule, 10 + 22 * 3 - 1, 61) == 41 and pages_within(41, 10, rule, 10**6, 61) == 61
    assert pages_freeing(61, 10, None, 25, 2) == 58 and pages_within(58, 10, None, 25, 61) == 60


def _sim_engine(tmp_path, make_tiny_hf_model, device_total: int):
    """A tiny Gemma 3 of a 256-token context planned on a simulated card of
    ``device_total`` bytes (no reserve, no margin): the engine and transformers' model."""
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    hf = make_tiny_hf_model("gemma3", tmp_path, vocab_size=VOCAB, max_position_embeddings=256)
    config = EngineConfig(model=str(tmp_path), device="cpu", page_size=4, max_prefill_tokens=16,
                          max_running_requests=8, reserve=0, safety_margin_bytes=0, min_context=32,
                          device_total=device_total)
    return Engine(config), hf


def _plan_bytes(engine) -> tuple[int, int]:
    """The plan's bytes of one KV pool page and one ring pool page."""
    plan = engine.plan
    rings = next(e.bytes for e in plan.ledger if e.name == "sliding-window KV rings")
    return plan.kv_pool_bytes // plan.num_pages, rings // (plan.kv_ring_pages + 1)


def _run(engine, prompts, steps, resizes):
    """Run ``prompts`` for ``steps`` greedy ids each, resizing the KV pool to
    ``resizes[k]`` pages (null page included) after step ``k``; the ids and each resize's
    result."""
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=greedy_params(steps)))
    out, results, step = {f"r{i}": [] for i in range(len(prompts))}, [], 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        step += 1
        if step in resizes:
            results.append(engine.resize_kv_pool(resizes[step], reason="test"))
    return [out[f"r{i}"] for i in range(len(prompts))], results


def test_a_live_resize_resizes_the_ring_pool_by_the_rule_and_frees_both_pools(tmp_path, make_tiny_hf_model):
    """A card whose plan holds the whole context (64 pages) and the rings' bound beside
    135 pages: shrunk mid-run to 100 pages (past the context: the rings keep their bound),
    to 40 (the floor, 20 pages) and grown back to 64 and to the plan's 135, the ring pool
    is the rule's at each size, the bytes freed or taken are the plan's for both pools,
    the plan shown follows, and 6 requests answer transformers' greedy ids."""
    from service.supervision.live_plan import plan_now

    engine, hf = _sim_engine(tmp_path, make_tiny_hf_model, 539_700_000)
    rule, plan = engine.ring_rule, engine.plan
    assert (plan.num_pages, plan.kv_ring_pages, rule.full_cap, rule.floor_cap, rule.wanted_pages) == (135, 52, 52, 20, 64)
    assert engine.ring.allocator.num_usable == 52 and engine.allocator.num_usable == 135
    page, ring_page = _plan_bytes(engine)
    assert (page, ring_page) == (engine.pool.page_bytes, engine.pool.ring_page_bytes) == (2048, 4096)
    prompts = seeded_prompts(VOCAB, *[9 + i for i in range(6)])
    ids, results = _run(engine, prompts, 12, {2: 101, 4: 41, 7: 65, 9: 136})
    assert [(r.after_pages - 1, r.after_ring_pages - 1) for r in results] == [(100, 52), (40, 20), (64, 20), (135, 52)]
    for r in results:
        assert r.after_ring_pages - 1 == rule.rings(r.after_pages - 1)
        planned = pool_cost(r.before_pages, page, rule) - pool_cost(r.after_pages, page, rule)
        assert r.before_bytes - r.after_bytes == planned
    assert results[1].before_bytes - results[1].after_bytes == 60 * page + 32 * ring_page
    info, shown = engine.info, engine.drain_events()
    assert [e.after_ring_pages - 1 for e in shown if e.action == "resize_pool"] == [52, 20, 20, 52]
    after_40 = next(e for e in shown if e.after_pages == 41)
    assert plan_now(info, after_40).kv_ring_pages == 20
    assert engine.ring.allocator.num_free + engine.ring.checkpoint_pages_held == 52
    assert ids == [hf_greedy(hf, p, 12) for p in prompts]


def test_a_shrink_below_the_pages_the_rings_hold_preempts_and_answers_the_same(tmp_path, make_tiny_hf_model):
    """8 decoding requests of 6-token prompts hold 3 ring pages each (24) and the prefix
    cache's checkpoints 16 more: a shrink to the wanted context's 64 pages, which hold
    every request's KV pages, gives the ring pool its floor of 20, below what the rings
    hold: the checkpoints are dropped, the youngest requests preempted for the rest, the
    ring pages left above the cut moved below it, and every request still answers
    transformers' greedy ids."""
    engine, hf = _sim_engine(tmp_path, make_tiny_hf_model, 539_700_000)
    prompts = seeded_prompts(VOCAB, *[6] * 8)
    held = []
    engine.step = _watching(engine.step, lambda: held.append(
        (sum(len(r.ring) for r in engine.scheduler.running), engine.ring.checkpoint_pages_held)))
    ids, results = _run(engine, prompts, 10, {7: 65})
    (shrink,) = results
    assert held[6] == (24, 16) and shrink.after_ring_pages - 1 == 20 and shrink.after_pages - 1 == 64
    assert shrink.preempted == ["r7", "r6"] and shrink.relocated_pages > 0
    assert ids == [hf_greedy(hf, p, 10) for p in prompts]


def _watching(step, after):
    """``step`` calling ``after()`` once it returned."""
    def watched():
        out = step()
        after()
        return out
    return watched


def test_the_controller_counts_the_ring_pages_a_resize_frees_and_takes():
    """Asked for 1 GiB by the watcher, the shrink takes the fewest KV pages whose resize
    frees it with the ring pages going with them: 200 pages of 1 MiB down to the wanted
    context, where the rings drop from their bound (300 pages of 5 MiB) to their floor
    (60), where pages alone would have taken 1,024; once memory is back for a hold, it
    grows back to the plan."""
    from engine.memory.plan import MiB
    from service.vram.replan import NewPoolSize, PoolState, ReplanController
    from service.vram.sources import VramSample

    page, ring_page, total = MiB, 5 * MiB, 64 * 1024 * MiB
    rule = RingRule(ring_page_bytes=ring_page, full_cap=300, floor_cap=60, wanted_pages=1000, planned_pages=1200,
                    planned_rings=300)
    fields = dict(planned_pages=1201, min_pages=65, page_bytes=page, prefill_chunk=256, planned_prefill_chunk=256,
                  ring=rule)
    ctl = ReplanController(512 * MiB, 2048 * MiB, hold_s=1.0, reserve=0)
    short = VramSample(timestamp=0.0, gpu=True, total_bytes=total, free_bytes=ctl.shrink_target_bytes - 1024 * MiB)
    pool = PoolState(pages=1201, **fields)
    (shrink,) = ctl.decide(short, pool)
    assert shrink == NewPoolSize(1001, 1201, shrink.reason)
    assert pool.bytes_at(1201) - pool.bytes_at(1001) == 200 * page + 240 * ring_page > 1024 * MiB
    assert pool.bytes_at(1201) - pool.bytes_at(1002) < 1024 * MiB
    back = [VramSample(timestamp=t, gpu=True, total_bytes=total, free_bytes=4 * 1024 * MiB) for t in (10.0, 11.5)]
    shrunk = PoolState(pages=1001, **fields)
    assert ctl.decide(back[0], shrunk) == []  # the hold
    (grow,) = ctl.decide(back[1], shrunk)
    assert grow == NewPoolSize(1201, 1001, grow.reason)
