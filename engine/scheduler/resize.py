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
    back to wait, youngest first."""

    ended: list[str] = field(default_factory=list)
    evicted_pages: int = 0
    moves: dict[int, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


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
        if not sched.running:
            raise RuntimeError(f"pages at or above {cut} are held, but by no running request")
        victim = max(sched.running, key=lambda r: r.arrival)
        sched.preempt(victim)
        preempted.append(victim.request_id)
        if radix is not None:
            # Its pages went to the prefix cache; those above the cut can go now.
            evicted += radix.evict_at_or_above(cut)
    moves = relocate_below(high, cut, alloc, (req.pages for req in sched.running), radix)
    if preempted:
        log.info("KV pool shrink to %d pages: preempted %s (youngest first)", cut, ", ".join(preempted))
    return Vacated(evicted_pages=evicted, moves=moves, preempted=preempted)


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
