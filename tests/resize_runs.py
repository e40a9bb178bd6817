"""Requests run to the end on a tiny engine whose KV pool is resized under them, with
every page accounted for after every step, for the live-resize tests
(``test_resize.py``, ``test_resize_timeline.py``).
"""

from __future__ import annotations

import torch
from tiny_engine import PAGE_SIZE, tiny_engine

from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams
from service.vram.replan import EmptyPrefixCache, NewChunkCap, NewPoolSize, PoolState

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


def make_engine(model: str, **overrides) -> Engine:
    """:func:`tiny_engine` with :data:`NUM_PAGES` pages unless ``overrides`` say otherwise."""
    return tiny_engine(model, **{"num_pages": NUM_PAGES, **overrides})


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
    out, final = serve(engine, [(0, rid, ids, sampling) for rid, ids in prompts.items()], on_step, max_steps)
    assert set(final) == set(prompts)
    return out, final


def serve(engine: Engine, stream, on_step=None, max_steps=2000):
    """Feed ``stream`` (``(arrival step, request id, prompt, sampling)`` rows, in arrival
    order) and run to the end, checking pages after every step; ``on_step(n, engine)``
    runs after step ``n``. Returns (outputs, final TokenOutputs)."""
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
        assert n <= max_steps, "the engine does not converge"
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
            if o.finished:
                final[o.request_id] = o
        check_pages(engine)
        if on_step is not None:
            on_step(n, engine)
            check_pages(engine)
    return out, final


def pool_state(engine: Engine, planned_pages: int) -> PoolState:
    """The replan controller's view of ``engine``'s pool, as the worker reports it, with
    ``planned_pages`` the plan's pool."""
    return PoolState(
        pages=engine.pool.num_pages,
        planned_pages=planned_pages,
        min_pages=engine.min_kv_pool_pages(),
        page_bytes=engine.kv_page_bytes,
        prefill_chunk=engine.scheduler.max_prefill_tokens,
        planned_prefill_chunk=engine.knobs.max_prefill_tokens,
        free_pages=engine.allocator.num_free,
        cached_pages=engine.radix.evictable_pages(),
    )


def carry_out(engine: Engine, actions) -> None:
    """Apply the replan controller's ``actions`` to ``engine`` at once, as the worker does."""
    for a in actions:
        if isinstance(a, NewChunkCap):
            engine.set_prefill_chunk(a.tokens, reason=a.reason)
        elif isinstance(a, EmptyPrefixCache):
            engine.evict_prefix_cache(reason=a.reason)
        elif isinstance(a, NewPoolSize):
            engine.resize_kv_pool(a.num_pages, reason=a.reason)
