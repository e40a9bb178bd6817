"""Sliding-window rings that grow with their request (:mod:`engine.kvcache.ring`,
:mod:`engine.scheduler.ring_growth`), on by default (``--sliding-kv-ring auto``): a
short request holds only its pages in the ring and a long one ``D`` between steps, a
chunk's size in its step, each live page kept in place when the size changes; many short
requests run at once where whole rings would not have fitted, with transformers'
greedy ids; requests sharing a cached prefix, which can make the ring pool the short
one, wait for ring pages; a ring pool short where its bound says it cannot be is a
bug, named; what excludes the ring."""

from __future__ import annotations

import math

import pytest
from model_checks import VOCAB, cpu_engine, greedy_params, hf_greedy, pair_fixture, seeded_prompts

from engine.core.footprint import kv_ring, kv_ring_excluded
from engine.kvcache.ring import RingPages, SlidingRing
from engine.memory.plan import PlanKnobs
from engine.wire.messages import GenerateRequest

pytest.importorskip("transformers")

pair = pair_fixture(["gemma3", "gemma4", "gpt_oss"], VOCAB)


def test_ring_fits_each_step_and_settles_between_steps():
    """The allocator alone (window 8, chunks of 4, pages of 4: D = 3, a chunk's step 4):
    a ring grows with its logical pages, takes a chunk's size for its step and gives it
    back after, and counts the tokens it can reach."""
    rings = RingPages(SlidingRing((0,), 8, 4, 4), num_pages=12)
    assert rings.ring.decode_pages == 3 and rings.ring.pages == 4
    ring: list[int] = []
    rings.fit(ring, 1, 0, 4)
    assert len(ring) == 1 and rings.wanted(ring, 3, 4) == 2
    rings.fit(ring, 3, 4, 4)
    assert len(ring) == 3 and rings.allocator.num_free == 11 - 3
    rings.fit(ring, 9, 32, 4)  # a chunk far past the window: pages_for(4) = 4
    assert len(ring) == 4 and rings.wanted(ring, 50, 4) == 0
    rings.settle(ring, 9, 36)
    assert len(ring) == 3 and rings.allocator.num_free == 8 and rings.reach(ring, 36) is None
    rings.fit(ring, 10, 36, 1)  # a decode step: D pages, nothing taken
    assert len(ring) == 3 and rings.allocator.num_free == 8
    other = rings.allocator.alloc(8)
    assert rings.reach(ring, 36) == 37  # 3 pages: one token past the window (pages_for(1) = 3)
    rings.give(other + ring)
    assert rings.allocator.num_free == rings.allocator.num_usable


@pytest.mark.parametrize("old,size", [(4, 3), (3, 4), (3, 6), (6, 3), (5, 5)])
def test_a_resized_ring_keeps_each_live_page_where_it_was(old, size):
    """A wrapped ring of ``old`` pages resized to ``size`` for a context of 41 tokens
    (11 logical pages): every logical page the new ring keeps (the last ``min(old,
    size)``) maps to the ring page that held it, so nothing is copied; pages it no longer
    needs go back, and new slots take free pages."""
    rings = RingPages(SlidingRing((0,), 8, 16, 4), num_pages=20)
    ring = rings.allocator.alloc(old)
    before = {j: ring[j % old] for j in range(11 - min(old, size), 11)}
    free = rings.allocator.num_free
    rings._resize(ring, size, 41)
    assert len(ring) == size == len(set(ring))
    assert {j: ring[j % size] for j in before} == before
    assert rings.allocator.num_free == free - (size - old)


def test_default_is_the_ring_and_it_grows_with_the_request(pair, monkeypatch):
    """The default takes the ring. A 6-token prompt decoding 4 tokens holds one ring page
    per global page (growing, D = 3 at most) at every step; a 40-token prompt decoding 30
    holds min(pages, D) between steps and a chunk's pages_for(8) = 5 in its prefill steps;
    the ring pool holds the global pool's pages at most."""
    _, _, _, _, path = pair
    engine = cpu_engine(path, max_prefill_tokens=8, max_running_requests=2)
    assert engine.ring is not None and engine.config.sliding_kv_ring == "auto"
    d, r = engine.ring.ring.decode_pages, engine.ring.ring.pages
    assert d == math.ceil(8 / 4) + 1 and r == math.ceil((8 + 7) / 4) + 1
    in_step: list[int] = []
    run = engine.runner.run

    def run_and_see(plan):  # the rings as the step's forward reads them
        in_step.extend(len(it.req.ring) for it in plan.items if it.num_tokens == 8 and it.start >= 16)
        return run(plan)

    monkeypatch.setattr(engine.runner, "run", run_and_see)
    short, long = seeded_prompts(VOCAB, 6, 40)
    engine.add_request(GenerateRequest(request_id="s", prompt_token_ids=short, sampling=greedy_params(4)))
    engine.add_request(GenerateRequest(request_id="l", prompt_token_ids=long, sampling=greedy_params(30)))
    seen: dict[str, list[int]] = {"s": [], "l": []}
    while engine.has_work():
        engine.step()
        for req in engine.scheduler.running:
            assert len(req.ring) == min(len(req.pages), d)
            seen[req.request_id].append(len(req.ring))
    assert seen["s"] == sorted(seen["s"]) and seen["s"][0] < max(seen["s"]) <= d < r
    assert max(seen["l"]) == d and min(seen["l"]) < d
    assert in_step and set(in_step) == {r}
    assert engine.ring.allocator.num_free + engine.ring.checkpoint_pages_held == engine.ring.allocator.num_usable


def test_many_short_requests_run_where_whole_rings_would_not(pair):
    """8 requests at once over a global pool of 39 pages: a ring pool of 39 pages holds
    5 whole rings of 7, but each request's ring grows with its 3 pages, so all 8 run
    together and each answers transformers' greedy ids."""
    _, hf, _, _, path = pair
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=40, max_prefill_tokens=16,
                                 max_running_requests=8))
    r = engine.ring.ring.pages
    assert r == 7 and engine.ring.allocator.num_usable == 39 < 8 * r
    prompts, steps = seeded_prompts(VOCAB, *[5 + i % 3 for i in range(8)]), 5
    sampling = greedy_params(steps)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"m{i}", prompt_token_ids=ids, sampling=sampling))
    out = {f"m{i}": [] for i in range(8)}
    most = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        most = max(most, len(engine.scheduler.running))
    assert most == 8
    assert [out[f"m{i}"] for i in range(8)] == [hf_greedy(hf, ids, steps) for ids in prompts]


def test_a_ring_pool_short_against_its_bound_is_a_bug(pair):
    """Ring pages taken from under the scheduler (what a leak would do): the next growth
    raises, naming a bug, rather than waiting forever."""
    kind, _, _, _, path = pair
    if kind != "gemma3":
        pytest.skip("one model shows the check")
    engine = cpu_engine(path, max_prefill_tokens=8, max_running_requests=2, prefix_cache=False)
    engine.ring.allocator.alloc(engine.ring.allocator.num_free)
    (ids,) = seeded_prompts(VOCAB, 6)
    engine.add_request(GenerateRequest(request_id="x", prompt_token_ids=ids, sampling=greedy_params(2)))
    with pytest.raises(RuntimeError, match="a bug in the ring's accounting"):
        engine.step()


def test_what_excludes_the_ring(pair):
    """``auto`` and ``on`` take the ring, under tensor parallelism too, but with FlashInfer
    (said in words, and the plan says why ``on`` was not taken); ``off`` never does."""
    _, _, _, config, _ = pair
    assert kv_ring(config, PlanKnobs()) is not None and kv_ring(config, PlanKnobs(sliding_kv_ring="on")) is not None
    assert kv_ring(config, PlanKnobs(sliding_kv_ring="off")) is None
    assert kv_ring(config, PlanKnobs(tensor_parallel_size=2)) is not None
    assert kv_ring_excluded(config, PlanKnobs(tensor_parallel_size=2)) == ""
    import torch

    from engine.core.footprint import make_footprint

    flashinfer = PlanKnobs(sliding_kv_ring="on", attention_backend="flashinfer")
    assert kv_ring(config, flashinfer) is None and "FlashInfer" in kv_ring_excluded(config, flashinfer)
    note = make_footprint(config, torch.float32, flashinfer).kv_window_note
    assert note.endswith("; no ring with the FlashInfer attention backend)")
    assert "no ring" not in make_footprint(config, torch.float32, PlanKnobs(sliding_kv_ring="off")).kv_window_note


def test_requests_sharing_a_prefix_wait_for_ring_pages(pair):
    """Eight requests continuing one cached 24-token prefix (6 pages) over a global pool of
    23 pages: each holds 2 global pages of its own but 3 ring pages or more (its prefix's
    among them), so the ring pool of 23 is the short one: requests wait or are preempted
    for ring pages, as for global pages, rather than fail, and each answers transformers'
    greedy ids."""
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    _, hf, _, _, path = pair
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=24, max_prefill_tokens=16,
                                 max_running_requests=8))
    assert engine.ring.allocator.num_usable == 23 and engine.ring.ring.decode_pages == 3
    (first,) = seeded_prompts(VOCAB, 26)
    sampling = greedy_params(4)
    engine.add_request(GenerateRequest(request_id="a", prompt_token_ids=first, sampling=sampling))
    while engine.has_work():
        engine.step()
    prompts = [first[:24] + tail for tail in seeded_prompts(VOCAB, *[2] * 8)]
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"w{i}", prompt_token_ids=ids, sampling=sampling))
    out = {f"w{i}": [] for i in range(8)}
    ring_bound = 0  # steps where a request waited with global pages to spare but no ring pages
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        sched = engine.scheduler
        if sched.waiting and engine.allocator.num_free >= 2 and engine.ring.allocator.num_free < 3:
            ring_bound += 1
    assert engine.scheduler.prefix_states.restored >= 2
    assert ring_bound > 0
    assert [out[f"w{i}"] for i in range(8)] == [hf_greedy(hf, ids, 4) for ids in prompts]


def test_a_planned_ring_pool_below_its_bound_keeps_the_context_and_requests_wait_for_it(tmp_path,
                                                                                       make_tiny_hf_model):
    """A tiny Gemma 3 of a 1,024-token context on a simulated card whose room holds that
    context (256 pages) but not the rings of all 16 requests beside it: the plan gives the
    ring pool what the context leaves (between its floor, 4 requests' rings, and its
    bound), the engine's ring pool is that size, and 12 requests of 30-token contexts,
    whose rings (3 pages each between steps) do not all fit, wait or are preempted for
    ring pages and each answers transformers' greedy ids."""
    from engine.commands.plan import build_plan
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    hf = make_tiny_hf_model("gemma3", tmp_path, vocab_size=VOCAB, max_position_embeddings=1024)
    knobs = dict(model=str(tmp_path), device="cpu", page_size=4, max_prefill_tokens=16, max_running_requests=16)
    ring = SlidingRing((0,), 8, 16, 4)
    floor, bound = ring.rings_bound(4), ring.rings_bound(16)

    def ring_pages(total: int) -> int:
        plan = build_plan(EngineConfig(device_total=total, **knobs))
        return plan.kv_ring_pages if plan.fits and plan.max_context_tokens == 1024 else 0

    low, high = 1 << 20, 1 << 34  # the smallest card whose ring pool reaches 30 pages beside the context
    while high - low > 1024:
        mid = (low + high) // 2
        low, high = (mid, high) if ring_pages(mid) < 30 else (low, mid)
    config = EngineConfig(device_total=high, **knobs)
    plan = build_plan(config)
    assert floor <= 30 <= plan.kv_ring_pages < bound and plan.max_context_tokens == 1024
    assert "so that the KV pool holds the context first; about" in next(
        e.source for e in plan.ledger if e.name == "sliding-window KV rings")
    engine = Engine(config)
    assert engine.ring.allocator.num_usable == plan.kv_ring_pages and engine.allocator.num_usable >= 256
    prompts, sampling = seeded_prompts(VOCAB, *[22 + i % 3 for i in range(12)]), greedy_params(6)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"p{i}", prompt_token_ids=ids, sampling=sampling))
    out = {f"p{i}": [] for i in range(12)}
    ring_bound = 0  # steps where a request waited with KV pages to spare but too few ring pages
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        if engine.scheduler.waiting and engine.allocator.num_free >= 8 and engine.ring.allocator.num_free < 3:
            ring_bound += 1
    assert ring_bound > 0
    assert [out[f"p{i}"] for i in range(12)] == [hf_greedy(hf, ids, 6) for ids in prompts]
