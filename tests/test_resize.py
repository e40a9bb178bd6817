"""Live resize of the KV pool on the CPU, as when another process takes or frees memory.

Four greedy requests run on a tiny random model; the pool shrinks under them (pages
moved below the cut, the prefix cache evicted first, the youngest preempted when pages
run short) and grows back. Every output must equal the undisturbed run, and after every
step every page must be accounted for: free, in the prefix cache, or owned by exactly
one running request, and none at or above the pool's size.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.common.errors import RequestRejected
from engine.kvcache.allocator import OutOfPages, PageAllocator
from engine.kvcache.pool import KVPool
from engine.wire.messages import (
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_POOL,
    GenerateRequest,
    Replanned,
    SamplingParams,
)

PAGE_SIZE = 4
NUM_PAGES = 128
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=g).tolist()

    shared = rand(8)  # two whole pages shared by r0, r1 and r3 through the prefix cache
    return {
        "r0": shared + rand(33),
        "r1": shared + rand(19),
        "r2": rand(40),
        "r3": shared + rand(13),
    }


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, make_tiny_hf_model) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3-resize")
    make_tiny_hf_model("qwen3", path)
    return str(path)


def make_engine(model: str, **overrides) -> Engine:
    cfg = dict(model=model, device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def check_pages(engine: Engine) -> None:
    """Every usable page is free, cached, or owned by one running request; nothing lives
    at or above the pool's size; allocator, pool and scheduler agree on the size. Pages
    a test took for itself (``engine.test_held``, to steer where requests land) count as
    owned."""
    sched, radix, alloc, pool = engine.scheduler, engine.radix, engine.allocator, engine.pool
    assert alloc.num_pages == pool.num_pages
    assert all(b.shape[0] == pool.num_pages * PAGE_SIZE for b in (*pool.k_buffers, *pool.v_buffers))
    tree = radix.all_pages()
    assert all(0 < p < pool.num_pages for p in tree), "a cached page outside the pool"
    own: list[int] = list(getattr(engine, "test_held", ()))
    for req in sched.running:
        assert all(0 < p < pool.num_pages for p in req.pages), req.request_id
        cached = req.cached_len // PAGE_SIZE
        assert set(req.pages[:cached]) <= tree, req.request_id
        own.extend(req.pages[cached:])
    assert len(own) == len(set(own)), "a page owned twice"
    assert not (set(own) & tree), "a request's own page is also in the prefix cache"
    free = set(alloc._free)
    assert len(free) == alloc.num_free and all(0 < p < alloc.num_pages for p in free)
    assert not (free & (set(own) | tree)), "a free page is also in use"
    assert alloc.num_free + len(tree) + len(own) == alloc.num_usable, "pages leaked"
    for req in sched.waiting:
        assert req.pages == [] and req.kv_len == 0 and req.last_node is None
    assert sched.max_context_tokens == engine.max_context_tokens == engine.info.max_context_tokens
    assert engine.max_context_tokens == min(128, (pool.num_pages - 1) * PAGE_SIZE)


def drive(engine: Engine, prompts=PROMPTS, *, sampling=GREEDY, on_step=None, max_steps=500):
    """Run ``prompts`` to the end, checking pages after every step; ``on_step(n, engine)``
    runs after step ``n``. Returns (outputs, final TokenOutputs)."""
    for rid, ids in prompts.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling))
    out = {rid: [] for rid in prompts}
    final = {}
    n = 0
    while engine.has_work():
        n += 1
        assert n <= max_steps, "the engine does not converge"
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
            if o.finished:
                final[o.request_id] = o
        check_pages(engine)
        if on_step is not None:
            on_step(n, engine)
            check_pages(engine)
    assert set(final) == set(prompts)
    return out, final


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


# -- the pieces ----------------------------------------------------------------------------


def test_allocator_resize():
    alloc = PageAllocator(10)
    taken = alloc.alloc(3)  # 1, 2, 3
    alloc.resize(16)
    assert (alloc.num_pages, alloc.num_usable, alloc.num_free) == (16, 15, 12)
    with pytest.raises(ValueError, match="2 page\\(s\\) at or above it are in use \\(2, 3\\)"):
        alloc.resize(2)
    assert alloc.num_pages == 16  # nothing changed
    alloc.free([2, 3])
    alloc.resize(4)  # page 1 held, 2 and 3 free
    assert (alloc.num_pages, alloc.num_free) == (4, 2)
    assert alloc.free_below(3) == 1 and alloc.alloc_below(1, 3) == [2]
    with pytest.raises(OutOfPages):
        alloc.alloc_below(1, 3)
    assert alloc.alloc(1) == [3]
    with pytest.raises(OutOfPages):
        alloc.alloc(1)
    with pytest.raises(ValueError, match="not a pool page"):
        alloc.free([5])
    alloc.free([1, 2, 3])
    alloc.resize(6)
    assert sorted(alloc.alloc(5)) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="at least 2 pages"):
        alloc.resize(1)
    assert taken == [1, 2, 3]


def _pool(num_pages: int, layers: int = 3) -> KVPool:
    pool = KVPool(
        num_layers=layers,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )
    g = torch.Generator().manual_seed(0)
    for b in (*pool.k_buffers, *pool.v_buffers):
        b.copy_(torch.randn(b.shape, generator=g))
    return pool


def test_pool_resize_keeps_the_pages_below_the_cut_and_zeroes_new_ones():
    pool = _pool(12)
    before = [b.clone() for b in (*pool.k_buffers, *pool.v_buffers)]
    pool.resize(5)
    assert pool.num_pages == 5 and pool.nbytes == 6 * 5 * PAGE_SIZE * 2 * 8 * 4
    for old, new in zip(before, (*pool.k_buffers, *pool.v_buffers), strict=True):
        assert torch.equal(new, old[: 5 * PAGE_SIZE])
    pool.resize(9)
    for old, new in zip(before, (*pool.k_buffers, *pool.v_buffers), strict=True):
        assert torch.equal(new[: 5 * PAGE_SIZE], old[: 5 * PAGE_SIZE])
        assert not new[5 * PAGE_SIZE :].any()
    with pytest.raises(ValueError):
        pool.resize(1)


def test_pool_copy_pages():
    pool = _pool(8)
    want = [b[3 * PAGE_SIZE : 5 * PAGE_SIZE].clone() for b in (*pool.k_buffers, *pool.v_buffers)]
    pool.copy_pages([3, 4], [6, 1])
    for w, b in zip(want, (*pool.k_buffers, *pool.v_buffers), strict=True):
        assert torch.equal(b[6 * PAGE_SIZE : 7 * PAGE_SIZE], w[:PAGE_SIZE])
        assert torch.equal(b[1 * PAGE_SIZE : 2 * PAGE_SIZE], w[PAGE_SIZE:])


@pytest.mark.parametrize("new_pages", [6, 40])
def test_pool_resize_never_holds_two_pools(monkeypatch, new_pages):
    """Layer by layer: at every allocation, the live buffers (old ones not yet dropped,
    new ones made) plus the one being made never exceed the larger pool plus one layer's
    new buffer."""
    pool = _pool(20, layers=4)
    old_total = pool.nbytes
    layer_new = new_pages * PAGE_SIZE * 2 * 8 * 4
    bound = max(old_total, layer_new * 8) + layer_new
    olds = [weakref.ref(b) for b in (*pool.k_buffers, *pool.v_buffers)]
    made: list[weakref.ref] = []
    peaks: list[int] = []
    real = pool._new_buffer

    def counting(num_pages, *, zero_from):
        live = sum(r().nbytes for r in (*olds, *made) if r() is not None)
        buf = real(num_pages, zero_from=zero_from)
        peaks.append(live + buf.nbytes)
        made.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(pool, "_new_buffer", counting)
    pool.resize(new_pages)
    assert len(peaks) == 8
    assert max(peaks) <= bound
    assert all(r() is None for r in olds), "an old buffer outlived the resize"


def test_pool_resize_out_of_memory_leaves_a_consistent_pool(monkeypatch):
    pool = _pool(10)
    before = [b.clone() for b in (*pool.k_buffers, *pool.v_buffers)]
    real, calls = pool._new_buffer, {"n": 0}

    def flaky(num_pages, *, zero_from):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(num_pages, zero_from=zero_from)

    monkeypatch.setattr(pool, "_new_buffer", flaky)
    with pytest.raises(torch.OutOfMemoryError):
        pool.resize(30)  # grow: back at 10 pages
    assert pool.num_pages == 10
    for old, new in zip(before, (*pool.k_buffers, *pool.v_buffers), strict=True):
        assert torch.equal(new, old)
    calls["n"] = 0
    with pytest.raises(torch.OutOfMemoryError):
        pool.resize(4)  # shrink: at 4 pages
    for old, new in zip(before, (*pool.k_buffers, *pool.v_buffers), strict=True):
        assert torch.equal(new, old[: 4 * PAGE_SIZE])


# -- live resize under running requests ----------------------------------------------------


def test_shrink_moves_live_pages_and_changes_no_output(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    hog = engine.test_held = engine.allocator.alloc(60)  # the requests get pages 61 and up
    seen = {}

    def on_step(n, e):
        if n == 3:
            e.allocator.free(hog)
            e.test_held = []
            live = e.scheduler.live_pages_at_or_above(64)
            assert live and len(e.scheduler.running) == 4
            contents = kv_contents(e)
            res = e.resize_kv_pool(64, reason="test shrink")
            assert (res.before_pages, res.after_pages) == (NUM_PAGES, 64)
            assert res.relocated_pages == len(live) and res.preempted == [] and res.ended == []
            assert res.after_bytes == res.before_bytes * 64 // NUM_PAGES
            assert e.pool.nbytes == res.after_bytes and e.info.num_pages == 64
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
            held = len(e.scheduler.live_pages_at_or_above(1))
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
                live = len(e.scheduler.live_pages_at_or_above(cut))
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


# -- the watcher and the controller drive a real engine ------------------------------------


def _stream(seed: int, n: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    """``n`` requests, two arriving every four steps: (step, id, prompt, sampling)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (8,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(
            3, 256, (int(torch.randint(8, 36, (1,), generator=g)),), generator=g
        ).tolist()
        prompt = (shared + tail) if i % 3 == 0 else tail
        sp = SamplingParams(
            max_new_tokens=int(torch.randint(12, 28, (1,), generator=g)),
            temperature=0.0,
            ignore_eos=True,
        )
        out.append((4 * (i // 2), f"q{i}", prompt, sp))
    return out


def _serve(engine: Engine, stream, on_step=None, max_steps=2000):
    """Feed ``stream`` by arrival step and run to the end; returns the final outputs."""
    out: dict[str, list[int]] = {}
    final = {}
    pending = list(stream)
    n = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= n:
            _, rid, prompt, sp = pending.pop(0)
            engine.add_request(
                GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp)
            )
            out[rid] = []
        n += 1
        assert n <= max_steps
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
            if o.finished:
                final[o.request_id] = o
        check_pages(engine)
        if on_step is not None:
            on_step(n, engine)
            check_pages(engine)
    return out, final


def test_a_desktop_timeline_drives_live_resizes_and_no_request_fails(tiny_dir):
    """The scripted desktop (a game takes 40% of the card, a browser spikes, both leave)
    seen through the simulated watcher, the replan controller deciding, the engine
    resizing its pool under a stream of requests: no request fails, every output equals
    the undisturbed run, the pool follows the timeline, and the decisions do not flap."""
    from service.vram.replan import (
        EmptyPrefixCache,
        NewChunkCap,
        NewPoolSize,
        PoolState,
        ReplanController,
    )
    from service.vram.simulated import SimulatedSource

    planned = 204
    stream = _stream(7, 40)
    ref_out, ref_final = _serve(make_engine(tiny_dir, num_pages=planned), stream)

    engine = make_engine(tiny_dir, num_pages=planned)
    KiB = 1 << 10
    page = engine.kv_page_bytes
    # A desktop card in miniature: weights and the rest, the pool, the desktop, the
    # reserve and the plan's safety margin, which is the headroom at the start.
    fixed, desktop, reserve, margin = 128 * KiB, 64 * KiB, 64 * KiB, 16 * KiB
    total = fixed + engine.pool.nbytes + desktop + reserve + margin
    game, browser = int(0.4 * total), 100 * KiB
    dt = 0.25  # seconds per step

    def others(t: float) -> int:
        # The game loads for two seconds from t=3, plays, and quits at t=15; the browser
        # spikes at t=8 for two seconds.
        loading = min(max((t - 3) / 2, 0.0), 1.0) if t < 15 else 0.0
        return desktop + int(game * loading) + (browser if 8 <= t < 10 else 0)

    source = SimulatedSource(total, others, ours_bytes=lambda: fixed + engine.pool.nbytes)
    ctl = ReplanController(
        low_water_bytes=4 * KiB, high_water_bytes=40 * KiB, hold_s=2.0, reserve=reserve
    )
    pages_over_time = []

    def on_step(n, e):
        s = source.sample(at=n * dt)
        state = PoolState(
            pages=e.pool.num_pages,
            planned_pages=planned,
            min_pages=e.min_kv_pool_pages(),
            page_bytes=page,
            prefill_chunk=e.scheduler.max_prefill_tokens,
            planned_prefill_chunk=e.knobs.max_prefill_tokens,
            min_prefill_chunk=256,
            free_pages=e.allocator.num_free,
            cached_pages=e.radix.evictable_pages(),
        )
        for a in ctl.decide(s, state):
            if isinstance(a, NewChunkCap):
                e.set_prefill_chunk(a.tokens, reason=a.reason)
            elif isinstance(a, EmptyPrefixCache):
                e.evict_prefix_cache(reason=a.reason)
            elif isinstance(a, NewPoolSize):
                e.resize_kv_pool(a.num_pages, reason=a.reason)
        pages_over_time.append((n * dt, e.pool.num_pages))

    out, final = _serve(engine, stream, on_step=on_step)
    assert out == ref_out
    assert all(f.finish_reason == "length" for f in final.values())
    assert engine.stats().failed == 0

    resizes = [
        ev
        for ev in engine.drain_events()
        if isinstance(ev, Replanned) and ev.action == REPLAN_RESIZE_POOL
    ]
    assert len(resizes) == ctl.shrinks + ctl.grows
    signs = []
    for ev in resizes:
        sign = "+" if ev.after_pages > ev.before_pages else "-"
        if not signs or signs[-1] != sign:
            signs.append(sign)
    assert signs == ["-", "+"], "the pool went down with the desktop and came back up"
    # Shrinks only while the game loaded (at most one per sample: it kept taking) and at
    # the browser's spike; one grow after each left, each after the hold.
    shrunk_at = [
        d.timestamp
        for d in ctl.decisions
        for a in d.actions
        if isinstance(a, NewPoolSize) and not a.grows
    ]
    grown_at = [
        d.timestamp
        for d in ctl.decisions
        for a in d.actions
        if isinstance(a, NewPoolSize) and a.grows
    ]
    assert all(3 <= t < 5.5 or 8 <= t < 8.75 for t in shrunk_at), shrunk_at
    assert len(grown_at) == 2 and grown_at[0] >= 10 + 2.0 and grown_at[1] >= 15 + 2.0

    def pages_at(t):
        return next(p for tt, p in pages_over_time if tt >= t)

    assert pages_at(2.5) == planned
    during_game = pages_at(7.5)
    assert during_game <= planned - (game - reserve) // page
    assert pages_at(9.5) < during_game, "the browser's spike took more"
    assert pages_at(9.5) >= engine.min_kv_pool_pages()
    assert pages_at(12.5) > pages_at(9.5), "the browser's share came back"
    assert engine.pool.num_pages == planned, "grown back once both left"
    assert engine.info.max_context_tokens == 128


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
