"""The KV cache's room split between the KV pool and a sliding-window ring pool
(:mod:`engine.memory.kv_fit`): the ring pool keeps its bound where the room holds it
beside the wanted context, else the wanted context comes first and the ring pool takes
what is left, at least its floor; the pages beside it are the most that fit."""

from __future__ import annotations

import pytest

from engine.memory.kv_fit import (
    RingPrice,
    RingRule,
    kv_pages,
    pages_in_bytes,
    ring_pool_cap,
    room_for,
    split_room,
)


def test_kv_pages_inverts_the_cost():
    # 10-byte pages, 3-byte ring pages, rings capped at 5 pages.
    assert kv_pages(0, 10, 3, 5) == 0 and kv_pages(100, 0) == 0
    assert kv_pages(64, 10, 3, 5) == 4  # below the cap: every page has its ring page (13 bytes)
    assert kv_pages(65 + 25, 10, 3, 5) == 7  # 5 pages with rings (65), then 10 bytes each
    for room in range(0, 300, 7):
        p = kv_pages(room, 10, 3, 5)
        assert p * 10 + min(p, 5) * 3 <= room < (p + 1) * 10 + min(p + 1, 5) * 3


@pytest.mark.parametrize("room,want", [
    (1000 * 10 + 100 * 3, 100),  # the bound beside the whole context: kept
    (1000 * 10 + 60 * 3, 60),  # 60 ring pages left beside the context
    (1000 * 10 + 10 * 3, 20),  # fewer than the floor left: the floor (the context is cut)
    (5000, 20),  # not even the context: the floor
])
def test_ring_pool_keeps_its_bound_or_what_the_context_leaves(room, want):
    # 10-byte pages, 3-byte ring pages; bound 100, floor 20, a wanted context of 1,000 pages.
    cap = ring_pool_cap(room, 10, 3, full_cap=100, floor_cap=20, wanted_pages=1000)
    assert cap == want
    p = kv_pages(room, 10, 3, cap)
    if want > 20 or room >= 1000 * 10 + 20 * 3:
        assert p >= 1000  # the whole context
    else:
        assert p < 1000


def test_ring_pool_cap_edges():
    assert ring_pool_cap(10**9, 10, 0, 100, 20, 1000) == 0  # no ring
    assert ring_pool_cap(50 * 10 + 50 * 3, 10, 3, 100, 20, 50) == 100  # a short context: its pages bound the rings
    assert ring_pool_cap(0, 10, 3, 10, 20, 1000) == 10  # a floor above the bound: the bound


def test_a_kv_cache_size_counts_both_pools_as_the_plan_does():
    """The control API's ``kv_cache_bytes`` in pages: without a ring, whole pages; with one,
    the most usable pages whose ring pages beside them (the live rule's) fit the size too."""
    assert pages_in_bytes(0, 10, None) == 1 and pages_in_bytes(105, 10, None) == 11
    ring = RingRule(ring_page_bytes=3, full_cap=100, floor_cap=20, wanted_pages=1000, planned_pages=1100,
                    planned_rings=100)
    for size in (0, 9, 13, 500, 10_000 + 60, 10_000 + 300, 12_345):
        usable = pages_in_bytes(size, 10, ring) - 1
        used = lambda n: n * 10 + ring.rings(n) * 3  # noqa: E731
        assert used(usable) <= size or usable == 0
        assert used(usable + 1) > size
    assert pages_in_bytes(10_000 + 20 * 3, 10, ring) == 1001  # the context with the floor's rings


def test_a_size_splits_as_a_cards_room_and_the_live_rule_reads_it_back():
    """``--kv-cache`` at start (:func:`split_room`): the room for ``n`` KV pages
    (:func:`room_for`) is the least that holds them, ``n`` within the wanted context, and the
    control API (:func:`pages_in_bytes`) over the rule the start leaves gives the start's
    pages for the same size."""
    page = 10
    for ring in (RingPrice(page_bytes=3, full_cap=100, floor_cap=20), RingPrice(page_bytes=50, full_cap=30,
                                                                              floor_cap=40)):
        for wanted in (0, 15, 60, 500):
            for n in (n for n in (1, 10, 25, 120, 400) if n <= wanted):
                least = room_for(n, page, ring)
                assert split_room(least, page, ring, wanted)[0] >= n > split_room(least - 1, page, ring, wanted)[0]
            for size in range(0, 12_000, 97):
                pages, rings = split_room(size, page, ring, wanted)
                assert pages * page + rings * ring.page_bytes <= size
                rule = RingRule(ring_page_bytes=ring.page_bytes, full_cap=ring.full_cap, floor_cap=ring.floor_cap,
                                wanted_pages=wanted, planned_pages=pages, planned_rings=rings)
                if pages:
                    assert pages_in_bytes(size, page, rule) == pages + 1, (ring, wanted, size)
    assert split_room(105, 10, None, 7) == (10, 0) and room_for(10, 10, None) == 100
