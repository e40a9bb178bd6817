"""What a live KV pool resize asks of the scheduler: room above a cut.

A pool shrinks from the top, so before the allocator and the pool drop the pages at or
above the cut, the scheduler makes every one of them free, on its own requests and its
own prefix cache, in this order:

1. Requests that no longer fit the new per-request context limit end
   (:func:`end_beyond_context`), waiting ones included, so none waits forever for room
   that is gone.
2. Unreferenced prefix-cache pages at or above the cut are evicted.
3. Live pages at or above the cut (a request's own, or the prefix cache's, shared or
   not) get free ids below it (:func:`engine.kvcache.relocate.relocate_below`). When
   there are too few, least recently used cache pages are evicted, then the youngest
   running requests are preempted (their computed pages stay cached while room allows;
   they are recomputed later, so greedy outputs do not change).

A model whose sliding-window layers keep a ring (:mod:`engine.kvcache.ring`) has a ring
pool beside, which the resize follows (:class:`engine.memory.kv_fit.RingRule`); a ring
pool that shrinks frees its pages at or above the cut the same way
(:func:`shrink_rings`): live ring pages (a running request's ring, a prefix-cache
checkpoint) get free ids below it, and where there are too few, the checkpoints are
dropped, least recently used first, then the youngest running requests preempted.

No tensor is touched here: :class:`Vacated` carries the page moves, which the engine
copies in the KV pool before the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.radix import RadixCache
from engine.kvcache.relocate import relocate_below
from engine.kvcache.ring import RingPages
from engine.memory.kv_fit import usable_pages
from engine.scheduler.request import Request
from engine.wire.messages import FINISH_LENGTH

log = logging.getLogger("headroom.engine")


class Scheduler(Protocol):
    """What a resize reads and calls on :class:`engine.scheduler.scheduler.Scheduler`
    (declared here, so this module does not import the scheduler that imports it)."""

    running: list[Request]
    waiting: Iterable[Request]
    allocator: PageAllocator
    radix: RadixCache | None
    ring: RingPages | None
    max_context_tokens: int

    def finish(self, req: Request, reason: str) -> None: ...

    def fail(self, req: Request, code: str, message: str) -> None: ...

    def preempt(self, req: Request) -> None: ...


@dataclass(frozen=True)
class Vacated:
    """What a shrink did to the pages: ``ended`` are the ids of requests that no longer
    fit the context limit (:func:`end_beyond_context`), ``evicted_pages`` left the prefix
    cache, ``moves`` maps each live page that was at or above the cut to its new id below
    it (copy their keys and values in that direction), ``preempted`` are request ids sent
    back to wait, youngest first; ``ring_moves`` are the ring pool's moves (its
    :func:`shrink_rings`)."""

    ended: list[str] = field(default_factory=list)
    evicted_pages: int = 0
    moves: dict[int, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    ring_moves: dict[int, int] = field(default_factory=dict)


def end_beyond_context(sched: Scheduler) -> list[str]:
    """End the requests (running or waiting) that have no room for one more token within
    ``sched.max_context_tokens``; returns their ids.

    A request that has produced output ends with ``finish_reason="length"`` (it stopped
    at the context limit, as on a pool of that size from the start; what was streamed
    stays valid); one that has not fails with ``error_code="out_of_memory"``: its prompt
    alone no longer fits, the memory was taken by another process and may come back, so
    "retry later" is the honest answer, where ``context_length_exceeded`` would blame
    the prompt.
    """
    limit = sched.max_context_tokens
    ended = []
    for req in [*sched.running, *sched.waiting]:
        if req.total_len < limit:
            continue  # room for at least one more token
        if req.output_ids:
            sched.finish(req, FINISH_LENGTH)
        else:
            sched.fail(req, "out_of_memory", (
                f"the KV cache shrank while this request waited or ran (another process "
                f"took device memory): one request may now hold {limit} tokens, and its "
                f"prompt has {len(req.prompt_ids)}; retry later, or with a shorter prompt"
            ))
        ended.append(req.request_id)
    return ended


def live_pages_at_or_above(sched: Scheduler, cut: int) -> list[int]:
    """Pages at or above ``cut`` that a running request or the prefix cache holds, sorted."""
    live = {p for req in sched.running for p in req.pages if p >= cut}
    if sched.radix is not None:
        live.update(p for p in sched.radix.all_pages() if p >= cut)
    return sorted(live)


def vacate_above(sched: Scheduler, cut: int) -> Vacated:
    """Make every page at or above ``cut`` free (steps 2 and 3 of the module docstring).

    Raises:
        RuntimeError: pages at or above ``cut`` are held, but by no running request (a
            bookkeeping bug).
    """
    alloc, radix = sched.allocator, sched.radix
    evicted = radix.evict_at_or_above(cut) if radix is not None else 0
    preempted: list[str] = []
    while True:
        high = live_pages_at_or_above(sched, cut)
        short = len(high) - alloc.free_below(cut)
        if short <= 0:
            break
        got = radix.evict(short) if radix is not None else 0
        evicted += got
        if got:
            continue
        preempted.append(_preempt_youngest(sched, f"pages at or above {cut} are held, but by no running request"))
        if radix is not None:
            # Its pages went to the prefix cache; those above the cut can go now.
            evicted += radix.evict_at_or_above(cut)
    moves = relocate_below(high, cut, alloc, (req.pages for req in sched.running), radix)
    if preempted:
        # Usable pages, as the resize's own line and every surface count them.
        log.info("KV pool shrink to %d pages: preempted %s (youngest first)", usable_pages(cut), ", ".join(preempted))
    return Vacated(evicted_pages=evicted, moves=moves, preempted=preempted)


def _preempt_youngest(sched: Scheduler, bug: str) -> str:
    """Preempt the youngest running request; returns its id.

    Raises:
        RuntimeError: ``bug``, when none runs.
    """
    if not sched.running:
        raise RuntimeError(bug)
    victim = max(sched.running, key=lambda r: r.arrival)
    sched.preempt(victim)
    return victim.request_id


def shrink_rings(sched: Scheduler, ring_pages: int) -> Vacated:
    """Shrink ``sched``'s ring pool to ``ring_pages`` pages (null page included): give each
    live ring page at or above the cut a free id below it, dropping prefix-cache
    checkpoints (least recently used first), then preempting the youngest running
    requests where too few are free; then shrink its allocator. The caller copies the
    returned ``ring_moves`` in the ring layers before the next step.

    Raises:
        RuntimeError: ring pages at or above the cut are held, but by no running request
            and no checkpoint (a bookkeeping bug).
    """
    rings, radix = sched.ring, sched.radix
    preempted: list[str] = []
    while True:
        high = sorted({p for req in sched.running for p in req.ring if p >= ring_pages}
                      | {p for pages in rings.checkpoint_lists() for p in pages if p >= ring_pages})
        if len(high) <= rings.allocator.free_below(ring_pages):
            break
        if radix is not None and radix.drop_lru_state():
            continue
        preempted.append(_preempt_youngest(sched, f"ring pages at or above {ring_pages} are held, but by no "
                                                  "running request"))
    lists = [*(req.ring for req in sched.running), *rings.checkpoint_lists()]
    moves = relocate_below(high, ring_pages, rings.allocator, lists, None)
    rings.allocator.resize(ring_pages)
    if preempted:
        log.info("ring pool shrink to %d pages: preempted %s (youngest first)", ring_pages, ", ".join(preempted))
    return Vacated(ring_moves=moves, preempted=preempted)


def shrink_pages(sched: Scheduler, num_pages: int, max_context_tokens: int) -> Vacated:
    """Shrink ``sched``'s pages to ``num_pages`` (null page included) under a context limit
    of ``max_context_tokens``: end what no longer fits, free every page at or above
    ``num_pages`` (evicting, moving, preempting: the module docstring), then shrink the
    allocator. The caller copies the returned ``moves`` in the KV pool before the next
    step."""
    sched.max_context_tokens = max_context_tokens
    ended = end_beyond_context(sched)
    vacated = vacate_above(sched, num_pages)
    sched.allocator.resize(num_pages)
    return replace(vacated, ended=ended)


def grow_pages(sched: Scheduler, num_pages: int, max_context_tokens: int) -> None:
    """Grow ``sched``'s pages to ``num_pages`` (null page included): the new ones are
    free, and the context limit rises to ``max_context_tokens``."""
    sched.allocator.resize(num_pages)
    sched.max_context_tokens = max_context_tokens
