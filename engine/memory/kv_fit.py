"""How the KV cache's room splits between the KV pool's pages and, for a model whose
sliding-window layers keep only their window (:mod:`engine.kvcache.ring`), the ring pool
of those layers: :func:`ring_pool_cap` chooses the ring pool's size, :func:`kv_pages` the
pages beside it. Torch-free.

The ring pool never runs short before the KV pool where it holds its bound, the rings of
every running request and the prefix cache's checkpoints (``full_cap``). On a desktop
card that bound can take most of the room (Gemma 3 4B at the defaults: 64 requests x 65
pages of 29 layers) and cut the context of every request to a fraction of the model's,
though one user rarely runs many long requests at once. So the plan keeps the bound only
where the room holds it beside the whole wanted context; else it gives the KV pool the
wanted context first and the ring pool what is left, at least the rings of
``RING_FLOOR_REQUESTS`` requests (the parallel sequences llama.cpp's server plans for by
default). Requests whose rings do not fit then wait or are preempted for ring pages, as
for KV pages (:mod:`engine.scheduler.ring_growth`); a short request's ring holds only its
own pages, so many short requests still run together.

A live replan resizes the ring pool with the KV pool by the same rule
(:class:`RingRule`), and prices a resize with both (:func:`pool_cost`).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

# Requests at their whole window the ring pool holds at least when it is sized below its
# bound (the parallel sequences llama.cpp's server plans for by default).
RING_FLOOR_REQUESTS = 4

# Page 0 of a pool (the KV pool, a ring pool) is never handed out: padded page tables
# point at it. The engine sizes pools with it; people read the pages requests can use.
NULL_PAGES = 1


def usable_pages(pages: int) -> int:
    """The pages requests can use in a pool of ``pages`` pages (its null page included,
    as the engine, ``--num-pages`` and the wire's ``pages`` fields count it): the count
    every surface a person reads gives (the plan, ``/api/status``, the control API's
    answers, replan events, the log); 0 for no pool."""
    return max(pages - NULL_PAGES, 0)


def kv_pages(room: int, page_bytes: int, ring_page: int = 0, ring_cap: int = 0) -> int:
    """The most KV pool pages ``P`` whose cost fits ``room`` bytes, the inverse of ``P x
    page_bytes + min(ring_cap, P) x ring_page`` (pages of the global layers, and a
    sliding-window ring pool of ``min(ring_cap, P)`` pages: :mod:`engine.kvcache.ring`);
    0 when nothing fits or a page costs nothing."""
    if room <= 0 or page_bytes <= 0:
        return 0
    both = page_bytes + ring_page
    if room < ring_cap * both:
        return room // both
    return ring_cap + (room - ring_cap * both) // page_bytes


def ring_pool_cap(room: int, page_bytes: int, ring_page: int, full_cap: int, floor_cap: int,
                  wanted_pages: int) -> int:
    """The ring pool's pages (its null page apart) the plan allows, given ``room`` bytes
    for the KV pool of ``page_bytes`` pages and the ring pool of ``ring_page`` pages:
    ``full_cap`` (the rings' bound and the checkpoints) where the room holds it beside
    ``wanted_pages`` KV pool pages (the wanted context), else the ring pages the room
    leaves beside those pages, at least ``floor_cap`` (the rings of
    :data:`RING_FLOOR_REQUESTS` requests) and at most ``full_cap``. 0 without a ring
    (``ring_page`` 0)."""
    if ring_page <= 0:
        return 0
    if wanted_pages * page_bytes + min(wanted_pages, full_cap) * ring_page <= room:
        return full_cap
    spare = max(room - wanted_pages * page_bytes, 0) // ring_page
    return max(min(floor_cap, full_cap), min(full_cap, spare))


class RingPrice(msgspec.Struct, frozen=True, kw_only=True):
    """A ring pool's price beside the KV pool, for sizing the two from one room
    (:func:`split_room`); :meth:`engine.kvcache.ring_geometry.SlidingRing.price` makes it.

    Attributes:
        page_bytes: one ring page over the sliding layers, keys and values.
        full_cap: the rings' bound: every running request's ring and the prefix cache's
            checkpoints, in pages.
        floor_cap: the rings of :data:`RING_FLOOR_REQUESTS` requests, in pages.
    """

    page_bytes: int
    full_cap: int
    floor_cap: int


def split_room(room: int, page_bytes: int, ring: RingPrice | None, wanted_pages: int) -> tuple[int, int]:
    """``(KV pool pages, ring pool pages)``, null pages apart, that ``room`` bytes hold
    together, split as the plan splits a card's room: the ring pool's pages
    (:func:`ring_pool_cap`: the bound where the room holds it beside ``wanted_pages``
    KV pages, else what the room leaves beside them, at least the floor) and the most
    KV pages of ``page_bytes`` beside them (:func:`kv_pages`). ``(room // page_bytes,
    0)`` without a ring."""
    if ring is None:
        return max(room, 0) // page_bytes, 0
    cap = ring_pool_cap(room, page_bytes, ring.page_bytes, ring.full_cap, ring.floor_cap, wanted_pages)
    pages = kv_pages(room, page_bytes, ring.page_bytes, cap)
    return pages, min(pages, cap)


def room_for(pages: int, page_bytes: int, ring: RingPrice | None) -> int:
    """The least room, in bytes, that :func:`split_room` gives ``pages`` KV pool pages or
    more, ``pages`` at most the wanted pages (a request of the minimum context, or of the
    wanted one): those pages and ``min(pages, floor_cap, full_cap)`` ring pages beside
    them (the ring a request of ``pages`` pages takes, within the floor the split keeps).
    Past the wanted pages the split gives the rings their bound first, so more may be
    needed."""
    rings = min(pages, ring.floor_cap, ring.full_cap) * ring.page_bytes if ring is not None else 0
    return pages * page_bytes + rings


def ring_line(rings: int, ring_page_text: str, *, cap: int, kv_pages: int, full_cap: int, ring_pages: int,
              checkpoint_pages: int, requests: int, checkpoints: int, decode_pages: int,
              floor_requests: int) -> str:
    """The ledger's words on a ring pool of ``rings`` pages (of ``ring_page_text`` each),
    at most ``cap`` (:func:`ring_pool_cap`'s) and the KV pool's ``kv_pages``: what bounds
    it (the KV pool's pages; the room left beside the wanted context; or its bound
    ``full_cap``, ``ring_pages`` for the rings of ``requests`` running requests and
    ``checkpoint_pages`` for ``checkpoints`` prefix-cache checkpoints), and about how
    many requests hold a whole window (``decode_pages`` each) at once."""
    made_of = (f"the rings of {requests} requests ({ring_pages} pages) and {checkpoints} prefix-cache checkpoints "
               f"({checkpoint_pages} pages)")
    if rings < cap:
        bound = f"as many as the KV pool's {kv_pages} pages, fewer than the {full_cap} of {made_of}"
    elif cap < full_cap:
        whole = min(max(rings // max(decode_pages, 1), 1), requests)
        bound = (f"fewer than the {full_cap} of {made_of}, so that the KV pool holds the context first; about "
                 f"{whole} requests at their whole window at once (never fewer than {floor_requests}); a request "
                 f"whose ring does not fit waits for ring pages")
    else:
        bound = made_of
    return (f"exact, {rings} pages of {ring_page_text}: {bound}. A request's ring holds its window ({decode_pages} "
            f"pages) between steps and a prefill chunk's pages more in its step; and the null page")


class RingRule(msgspec.Struct, frozen=True, kw_only=True):
    """The ring pool beside a KV pool that a live replan resizes: the rule
    :func:`ring_pool_cap` applies at start, over the least room that holds the KV pool's
    pages. Pages are usable ones (null pages apart); bytes are as the plan counts them.

    Beside ``P`` KV pool pages the ring pool holds ``min(P, floor_cap)`` pages while ``P``
    is at most ``wanted_pages`` (the context first: a room that does not hold the wanted
    context gives the rings their floor), ``min(P, full_cap)`` past it (the room holds
    the context, and the least room for more pages holds the rings' bound too); at
    ``planned_pages`` it holds ``planned_rings``, the start's (where the start's room held
    the context and part of the bound beside it), and never fewer below or more above it.

    Attributes:
        ring_page_bytes: one ring pool page over the sliding layers, keys and values.
        full_cap: the rings of every running request and the checkpoints' pages.
        floor_cap: the rings of :data:`RING_FLOOR_REQUESTS` requests.
        wanted_pages: KV pool pages of the wanted context (0 without a plan: the ring pool
            is then ``min(P, full_cap)``, as at start).
        planned_pages, planned_rings: the KV pool's and the ring pool's pages at start.
    """

    ring_page_bytes: int
    full_cap: int
    floor_cap: int
    wanted_pages: int
    planned_pages: int
    planned_rings: int

    def rings(self, pages: int) -> int:
        """Ring pool pages beside ``pages`` KV pool pages, at least 1 (see the class
        docstring)."""
        least = min(pages, self.full_cap if pages > self.wanted_pages else min(self.floor_cap, self.full_cap))
        if pages < self.planned_pages:
            least = min(least, self.planned_rings)
        elif pages == self.planned_pages:
            least = self.planned_rings
        else:
            least = max(least, self.planned_rings)
        return max(least, 1)

    def bytes_past_start(self, pages: int) -> int:
        """Bytes of the ring pool beside ``pages`` KV pool pages beyond the start's
        (negative: fewer)."""
        return (self.rings(pages) - self.planned_rings) * self.ring_page_bytes


def largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``lo..hi`` with ``fits(n)``, ``fits`` true up to some ``n`` and
    false past it (a pool's bytes rise with its pages); ``lo`` when none above it fits."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def pool_cost(pages: int, page_bytes: int, ring: RingRule | None) -> int:
    """Bytes of a KV pool of ``pages`` pages (the null page included) of ``page_bytes``
    each, with the ring pool ``ring`` sets beside it (its null page apart: a constant)."""
    return pages * page_bytes + (ring.rings(pages - 1) * ring.ring_page_bytes if ring is not None else 0)


def pages_freeing(pages: int, page_bytes: int, ring: RingRule | None, need: int, least: int) -> int:
    """The largest KV pool (pages, null page included) between ``least`` and ``pages``
    whose shrink from ``pages`` frees ``need`` bytes or more (:func:`pool_cost`), else
    ``least``."""
    cost = pool_cost(pages, page_bytes, ring)
    # The cost rises with the pages: the last pool that frees enough.
    return largest(least, pages, lambda n: cost - pool_cost(n, page_bytes, ring) >= need)


def pages_within(pages: int, page_bytes: int, ring: RingRule | None, spare: int, most: int) -> int:
    """The largest KV pool (pages, null page included) between ``pages`` and ``most``
    whose grow from ``pages`` takes at most ``spare`` bytes (:func:`pool_cost`); ``pages``
    when not one page more fits."""
    cost = pool_cost(pages, page_bytes, ring)
    return largest(pages, max(most, pages), lambda n: pool_cost(n, page_bytes, ring) - cost <= spare)


def pages_in_bytes(size: int, page_bytes: int, ring: RingRule | None) -> int:
    """The largest KV pool (pages, null page included) whose usable pages and the ring
    pool ``ring`` sets beside them take at most ``size`` bytes: what a KV cache of
    ``size`` bytes holds, counted as the plan counts ``--kv-cache`` (both pools)."""
    def used(usable: int) -> int:
        return usable * page_bytes + (ring.rings(usable) * ring.ring_page_bytes if ring is not None else 0)

    return largest(0, max(size, 0) // page_bytes, lambda n: used(n) <= size) + 1
