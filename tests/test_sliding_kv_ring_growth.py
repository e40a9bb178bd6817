"""Sliding-window rings that grow with their request (:mod:`engine.kvcache.ring`,
:mod:`engine.scheduler.ring_growth`), on by default (``--sliding-kv-ring auto``): a
short request holds only its pages in the ring and a long one at most ``R``; many short
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


def test_ring_holds_its_pages_then_at_most_r():
    """The allocator alone: a ring grows to cover its logical pages, at most R, gives a
    step's growth back, and counts what it can reach."""
    rings = RingPages(SlidingRing((0,), 8, 4, 4), num_pages=12)  # R = 4
    ring: list[int] = []
    assert rings.grow(ring, 1) == ring and len(ring) == 1
    rings.grow(ring, 3)
    assert len(ring) == 3 and rings.allocator.num_free == 11 - 3
    rings.grow(ring, 9)
    assert len(ring) == 4 and rings.wanted(ring, 50) == 0 and rings.grow(ring, 50) == []
    rings.trim(ring, 2)
    assert len(ring) == 2 and rings.allocator.num_free == 9 and rings.reach(ring) is None
    other = rings.allocator.alloc(8)
    assert rings.reach(ring) == 3  # one page free: three logical pages at most
    rings.give(other + ring)
    assert rings.allocator.num_free == rings.allocator.num_usable


def test_default_is_the_ring_and_it_grows_with_the_request(pair):
    """The default takes the ring. A 6-token prompt decoding 4 tokens holds one ring page
    per global page (growing, 3 at most) at every step; a 40-token prompt decoding 30 holds
    min(pages, R), R at the end; the ring pool holds the global pool's pages at most."""
    _, _, _, _, path = pair
    engine = cpu_engine(path, max_prefill_tokens=8, max_running_requests=2)
    assert engine.ring is not None and engine.config.sliding_kv_ring == "auto"
    r = engine.ring.ring.pages
    assert r == math.ceil((8 + 8) / 4) + 1
    short, long = seeded_prompts(VOCAB, 6, 40)
    engine.add_request(GenerateRequest(request_id="s", prompt_token_ids=short, sampling=greedy_params(4)))
    engine.add_request(GenerateRequest(request_id="l", prompt_token_ids=long, sampling=greedy_params(30)))
    seen: dict[str, list[int]] = {"s": [], "l": []}
    while engine.has_work():
        engine.step()
        for req in engine.scheduler.running:
            assert len(req.ring) == min(len(req.pages), r)
            seen[req.request_id].append(len(req.ring))
    assert seen["s"] == sorted(seen["s"]) and seen["s"][0] < max(seen["s"]) <= 3 < r
    assert max(seen["l"]) == r and min(seen["l"]) < r
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
    """``auto`` and ``on`` take the ring but with tensor parallelism or FlashInfer (said
    in words), ``off`` never does."""
    _, _, _, config, _ = pair
    assert kv_ring(config, PlanKnobs()) is not None and kv_ring(config, PlanKnobs(sliding_kv_ring="on")) is not None
    assert kv_ring(config, PlanKnobs(sliding_kv_ring="off")) is None
    assert kv_ring_excluded(config, PlanKnobs(tensor_parallel_size=2)) == "tensor parallelism"
    flashinfer = PlanKnobs(sliding_kv_ring="on", attention_backend="flashinfer")
    assert kv_ring(config, flashinfer) is None and "FlashInfer" in kv_ring_excluded(config, flashinfer)


def test_requests_sharing_a_prefix_wait_for_ring_pages(pair):
    """Four requests continuing one cached 24-token prefix (6 pages) over a global pool of
    19 pages: each holds 2 global pages of its own but 7 ring pages (its prefix's among
    them), so the ring pool of 19 is the short one: requests wait or are preempted for
    ring pages, as for global pages, rather than fail, and each answers transformers'
    greedy ids."""
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    _, hf, _, _, path = pair
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=20, max_prefill_tokens=16,
                                 max_running_requests=4))
    assert engine.ring.allocator.num_usable == 19 and engine.ring.ring.pages == 7
    (first,) = seeded_prompts(VOCAB, 26)
    sampling = greedy_params(4)
    engine.add_request(GenerateRequest(request_id="a", prompt_token_ids=first, sampling=sampling))
    while engine.has_work():
        engine.step()
    prompts = [first[:24] + tail for tail in seeded_prompts(VOCAB, 2, 2, 2, 2)]
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"w{i}", prompt_token_ids=ids, sampling=sampling))
    out = {f"w{i}": [] for i in range(4)}
    ring_bound = 0  # steps where a request waited with global pages to spare but no ring pages
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        sched = engine.scheduler
        if sched.waiting and engine.allocator.num_free >= 2 and engine.ring.allocator.num_free < 7:
            ring_bound += 1
    assert engine.scheduler.prefix_states.restored >= 2
    assert ring_bound > 0
    assert [out[f"w{i}"] for i in range(4)] == [hf_greedy(hf, ids, 4) for ids in prompts]
