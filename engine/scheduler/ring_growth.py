"""A sliding-window ring's size in the scheduler (:mod:`engine.kvcache.ring`): each step
fits a request's ring to the step where its global pages grow, to ``min(its pages,
pages_for(step tokens))`` ring pages, taking the pages of prefix-cache checkpoints where
too few are free, and a ring pool that runs short is waited on as the global pool is,
after checking that it ran short the only way it can (two running requests sharing
cached prefix pages, or a ring pool below its bound beside the global pool's pages, as
the plan or a live resize sizes it: :class:`engine.memory.kv_fit.RingRule`); any other
shortage is a bug.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kvcache.allocator import OutOfPages

if TYPE_CHECKING:
    from engine.kvcache.allocator import PageAllocator
    from engine.kvcache.radix import RadixCache
    from engine.kvcache.ring import RingPages
    from engine.scheduler.request import Request


def grow_ring(rings: RingPages, req: Request, new_pages: list[int], allocator: PageAllocator,
              running: list[Request], radix: RadixCache | None, tokens: int = 1) -> None:
    """Fit ``req.ring`` to a step writing ``tokens`` tokens after ``req.kv_len``, over
    ``req.pages``, whose last ``new_pages`` were just taken from ``allocator`` (the global
    pool) for it, dropping the prefix cache's (``radix``) ring checkpoints where the free
    pages are too few.

    Raises:
        OutOfPages: too few ring pages are free; ``new_pages`` went back to the global
            pool and ``req`` is as before (the caller waits or preempts, as for global
            pages).
        RuntimeError: the ring pool ran short where its bound says it cannot (a bug).
    """
    # Prefix-cache checkpoints give their pages up first, least recently used first.
    need = rings.wanted(req.ring, len(req.pages), tokens)
    while rings.allocator.num_free < need and radix is not None and radix.drop_lru_state():
        pass
    try:
        rings.fit(req.ring, len(req.pages), req.kv_len, tokens)
    except OutOfPages:
        if not _may_run_short(rings, req, allocator, running):
            raise RuntimeError(
                f"the sliding-window ring pool ran out ({rings.allocator.num_usable} pages, "
                f"{rings.allocator.num_free} free) before the global pool "
                f"({allocator.num_free} free): a bug in the ring's accounting") from None
        if new_pages:
            allocator.free(new_pages)
            del req.pages[len(req.pages) - len(new_pages):]
        raise


def ring_tokens(rings: RingPages, req: Request) -> int | None:
    """The most tokens ``req``'s context can reach in its next step with the ring pages
    free now (None: no bound from the ring)."""
    return rings.reach(req.ring, req.kv_len)


def _may_run_short(rings: RingPages, req: Request, allocator: PageAllocator, running: list[Request]) -> bool:
    """Whether the ring pool may be short now (its checkpoints dropped) without a bug:
    running requests (``req`` among them) share a global page, or the ring pool holds
    fewer than ``min(rings_bound(requests), global pages)`` pages (the plan or a live
    resize sized it below its bound)."""
    holders = {id(r): r for r in (*running, req)}.values()
    held = [p for r in holders for p in r.pages]
    shared = len(held) != len(set(held))
    bound = min(rings.ring.rings_bound(len(holders)), allocator.num_usable)
    return shared or rings.allocator.num_usable < bound
