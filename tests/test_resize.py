"""Live resize of the KV pool on the CPU, as when another process takes or frees memory.

Four greedy requests run on a tiny random model; the pool shrinks under them (pages
moved below the cut, the prefix cache evicted first, the youngest preempted when pages
run short) and grows back. Every output must equal the undisturbed run, and after every
step every page must be accounted for (``resize_runs.check_pages``). The allocator's
and the pool's own resize are tested in ``test_kv_pool_resize.py``, a desktop timeline
driving the resizes in ``test_resize_timeline.py``.
"""

from __future__ import annotations

import pytest
import torch
from resize_runs import NUM_PAGES, PAGE_SIZE, check_pages, drive, make_engine

from engine.common.errors import RequestRejected
from engine.core.engine import Engine
from engine.scheduler.resize import live_pages_at_or_above
from engine.wire.messages import (
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_POOL,
    GenerateRequest,
    Replanned,
    SamplingParams,
)


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[str, list[int]]:
    out, final = drive(make_engine(tiny_dir))
    assert all(f.finish_reason == "length" for f in final.values())
    return out


def kv_contents(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Each running request's computed keys and values, layer by layer, read through its
    page list."""
    pool, out = engine.pool, {}
    for req in engine.scheduler.running:
        pos = torch.arange(req.kv_len)
        slots = torch.tensor(req.pages)[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        out[req.request_id] = [
            b.index_select(0, slots).clone() for b in (*pool.k_buffers, *pool.v_buffers)
        ]
    return out


def replans(engine: Engine) -> list[Replanned]:
    return [e for e in engine.drain_events() if isinstance(e, Replanned)]


# -- live resize under running requests ----------------------------------------------------


def test_shrink_moves_live_pages_and_changes_no_output(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    hog = engine.test_held = engine.allocator.alloc(60)  # the requests get pages 61 and up
    seen = {}

    def on_step(n, e):
        if n == 3:
            e.allocator.free(hog)
            e.test_held = []
            live = live_pages_at_or_above(e.scheduler, 64)
            assert live and len(e.scheduler.running) == 4
            contents = kv_contents(e)
            res = e.resize_kv_pool(64, reason="test shrink")
            assert (res.before_pages, res.after_pages) == (NUM_PAGES, 64)
            assert res.relocated_pages == len(live) and res.preempted == [] and res.ended == []
            assert res.after_bytes == res.before_bytes * 64 // NUM_PAGES
            assert e.pool.nbytes == res.after_bytes and e.info.num_pages == 63  # usable pages
            after = kv_contents(e)
            assert after.keys() == contents.keys()
            for rid in contents:
                for a, b in zip(contents[rid], after[rid], strict=True):
                    assert torch.equal(a, b), f"{rid}'s keys/values changed in the move"
            seen["res"] = res

    out, final = drive(engine, on_step=on_step)
    assert out == reference
    assert all(f.finish_reason == "length" for f in final.values())
    (event,) = replans(engine)
    res = seen["res"]
    assert (event.action, event.reason, event.before_pages, event.after_pages) == (
        REPLAN_RESIZE_POOL,
        "test shrink",
        NUM_PAGES,
        64,
    )
    assert (event.before_bytes, event.after_bytes, event.relocated_pages) == (
        res.before_bytes,
        res.after_bytes,
        res.relocated_pages,
    )
    assert event.duration_ms >= 0 and event.max_context_tokens == 128


def test_shrink_below_what_runs_preempts_the_youngest_then_grows_back(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    results = []

    def on_step(n, e):
        if n == 4:
            held = len(live_pages_at_or_above(e.scheduler, 1))
            results.append(e.resize_kv_pool(24, reason="squeeze"))
            assert held > 23
        if n == 12:
            results.append(e.resize_kv_pool(NUM_PAGES, reason="room again"))

    out, final = drive(engine, on_step=on_step)
    shrink, grow = results
    assert shrink.preempted and shrink.preempted[0] == "r3", "the youngest goes first"
    arrivals = {"r0": 0, "r1": 1, "r2": 2, "r3": 3}
    assert [arrivals[r] for r in shrink.preempted] == sorted(
        (arrivals[r] for r in shrink.preempted), reverse=True
    )
    assert "r0" not in shrink.preempted
    assert shrink.max_context_tokens == 23 * PAGE_SIZE
    assert (grow.before_pages, grow.after_pages, grow.max_context_tokens) == (24, NUM_PAGES, 128)
    assert grow.relocated_pages == 0 and grow.preempted == []
    assert out == reference
    assert all(f.finish_reason == "length" for f in final.values())
    assert engine.stats().failed == 0
    assert [(e.before_pages, e.after_pages) for e in replans(engine)] == [
        (NUM_PAGES, 24),
        (24, NUM_PAGES),
    ]


def test_shrink_evicts_the_prefix_cache_above_the_cut_first(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    hog = engine.test_held = engine.allocator.alloc(70)
    warm = {"warm": [5, 6, 7, 8] * 6}
    drive(engine, warm)  # its pages, now only cached, lie above 70
    cached = engine.radix.all_pages()
    assert cached and min(cached) > 70
    engine.allocator.free(hog)
    engine.test_held = []
    seen = {}

    def on_step(n, e):
        if n == 2:
            assert all(p < 64 for r in e.scheduler.running for p in r.pages)
            seen["res"] = e.resize_kv_pool(64)

    out, _ = drive(engine, on_step=on_step)
    res = seen["res"]
    assert res.evicted_pages == len(cached)
    assert res.relocated_pages == 0 and res.preempted == []
    assert not (engine.radix.all_pages() & cached)
    assert out == reference


def test_shrink_evicts_lru_cache_below_the_cut_to_make_room(tiny_dir, reference):
    """Cached pages low, running pages high, too few free pages below the cut: cached
    pages below it go too (least recently used first) to make room, then pages move;
    nobody is preempted."""
    engine = make_engine(tiny_dir)
    drive(engine, {"warm": [5, 6, 7, 8] * 6})  # cached in the lowest pages
    cached = engine.radix.all_pages()
    hog = engine.test_held = engine.allocator.alloc(
        40
    )  # right above them: the requests get the pages after
    seen = {}

    def on_step(n, e):
        if n == 2:
            e.allocator.free(hog)
            e.test_held = []
            assert min(p for r in e.scheduler.running for p in r.pages) > max(hog)
            for cut in range(NUM_PAGES, 2, -1):
                live = len(live_pages_at_or_above(e.scheduler, cut))
                free = e.allocator.free_below(cut)
                if free < live <= free + len(cached):
                    break
            else:
                raise AssertionError("no cut needs the cache to make room")
            seen.update(live=live, free=free, res=e.resize_kv_pool(cut))

    out, _ = drive(engine, on_step=on_step)
    res = seen["res"]
    assert res.relocated_pages == seen["live"] and res.preempted == []
    assert res.evicted_pages >= seen["live"] - seen["free"]
    assert out == reference


def test_context_limit_follows_the_pool(tiny_dir):
    """A running request beyond the new context ends with "length"; a waiting one whose
    prompt no longer fits fails with out_of_memory; new long prompts are refused; growing
    back restores the limit."""
    engine = make_engine(tiny_dir, max_running_requests=1)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request(
        GenerateRequest(request_id="long", prompt_token_ids=list(range(3, 43)), sampling=sp)
    )
    got: dict[str, list[int]] = {"long": [], "big": []}
    final = {}

    def step():
        for o in engine.step():
            got[o.request_id].extend(o.token_ids)
            if o.finished:
                final[o.request_id] = o
        check_pages(engine)

    for _ in range(4):
        step()
    engine.add_request(
        GenerateRequest(request_id="big", prompt_token_ids=list(range(3, 48)), sampling=sp)
    )
    step()
    assert engine.scheduler.waiting[0].request_id == "big"
    res = engine.resize_kv_pool(11)  # 10 pages: 40 tokens
    assert res.max_context_tokens == 40 == engine.info.max_context_tokens
    assert sorted(res.ended) == ["big", "long"]
    while engine.has_work():
        step()
    assert final["long"].finish_reason == "length" and len(got["long"]) == 5
    assert final["big"].finish_reason == "error" and final["big"].error_code == "out_of_memory"
    assert "may now hold 40 tokens" in final["big"].error_message
    with pytest.raises(RequestRejected, match="at most 40 tokens"):
        engine.add_request(GenerateRequest(request_id="x", prompt_token_ids=list(range(3, 43))))
    engine.resize_kv_pool(NUM_PAGES)
    assert engine.max_context_tokens == 128 == engine.info.max_context_tokens
    engine.add_request(
        GenerateRequest(
            request_id="x",
            prompt_token_ids=list(range(3, 43)),
            sampling=SamplingParams(max_new_tokens=2, temperature=0.0),
        )
    )
    while engine.has_work():
        engine.step()


def test_prefill_chunk_and_cache_eviction_are_replans(tiny_dir, reference):
    engine = make_engine(tiny_dir, max_prefill_tokens=64)
    assert engine.set_prefill_chunk(1000, reason="grow") == 64  # never above the plan's
    assert replans(engine) == []  # nothing changed
    assert engine.set_prefill_chunk(8, reason="squeeze") == 8
    out, _ = drive(engine)  # chunked prefill, same outputs
    assert out == reference
    cached = engine.radix.num_cached_pages
    assert cached > 0
    assert engine.evict_prefix_cache(reason="squeeze") == cached
    assert engine.evict_prefix_cache() == 0
    assert engine.allocator.num_free == engine.allocator.num_usable
    events = replans(engine)
    assert [e.action for e in events] == [REPLAN_PREFILL_CHUNK, REPLAN_EVICT_PREFIX_CACHE]
    assert events[0].max_prefill_tokens == 8 and events[1].evicted_pages == cached
    assert events[1].before_pages == events[1].after_pages == NUM_PAGES
    with pytest.raises(ValueError):
        engine.set_prefill_chunk(0)
    with pytest.raises(ValueError):
        engine.resize_kv_pool(1)


def test_repeated_resizes_every_step(tiny_dir, reference):
    """The pool jumps around every few steps, down to one request's context and back:
    outputs still equal the undisturbed run."""
    engine = make_engine(tiny_dir)
    sizes = [90, 40, 128, 34, 60, 34, 128, 50]

    def on_step(n, e):
        if n % 3 == 0:
            e.resize_kv_pool(sizes[(n // 3) % len(sizes)])

    out, final = drive(engine, on_step=on_step)
    assert out == reference
    assert all(f.finish_reason == "length" for f in final.values())
    assert engine.min_kv_pool_pages() == 33


def test_a_grow_that_runs_out_of_memory_leaves_the_engine_working(tiny_dir, reference, monkeypatch):
    engine = make_engine(tiny_dir)
    engine.resize_kv_pool(64)
    real, calls = engine.pool._new_buffer, {"n": 0}

    def flaky(num_pages, *, zero_from):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(num_pages, zero_from=zero_from)

    def on_step(n, e):
        if n == 3:
            monkeypatch.setattr(e.pool, "_new_buffer", flaky)
            with pytest.raises(torch.OutOfMemoryError):
                e.resize_kv_pool(NUM_PAGES)
            assert e.pool.num_pages == e.allocator.num_pages == 64
            monkeypatch.undo()

    out, _ = drive(engine, on_step=on_step)
    assert out == reference


def test_the_log_counts_the_pages_the_control_api_and_the_events_count(tiny_dir, caplog):
    """Usable pages, the null page left out, wherever people read a resize."""
    from engine.worker.process import _describe_resize

    engine = make_engine(tiny_dir)
    with caplog.at_level("INFO", logger="headroom.engine"):
        res = engine.resize_kv_pool(64, reason="test shrink")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool shrunk")]
    assert len(said) == 1 and f": {NUM_PAGES - 1} -> 63 pages (" in said[0], said
    from engine.common.units import fmt_bytes

    # The answer's bytes are the usable pages' (as `headroom plan` prices a pool), not the
    # buffers' with the null page.
    page = engine.pool.page_bytes
    answer = _describe_resize(res)
    assert f"KV pool {NUM_PAGES - 1} -> 63 pages ({fmt_bytes((NUM_PAGES - 1) * page)} -> {fmt_bytes(63 * page)})" \
        in answer, answer
