"""Page allocator and radix prefix cache: accounting that must never drift."""

import pytest

from engine.kvcache.allocator import OutOfPages, PageAllocator
from engine.kvcache.radix import RadixCache


def test_allocator_hands_out_lowest_pages_and_refuses_overdraw():
    a = PageAllocator(6)  # pages 1..5
    assert a.num_free == 5
    assert a.alloc(2) == [1, 2]
    with pytest.raises(OutOfPages):
        a.alloc(4)
    assert a.num_free == 3  # a refused allocation takes nothing
    a.free([1])
    assert a.alloc(1) == [1]


@pytest.mark.parametrize("bad", [[0], [6], [3, 3]])
def test_allocator_rejects_bad_frees(bad):
    a = PageAllocator(6)
    a.alloc(5)
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.num_free == 0


def _cache(num_pages=32, ps=2):
    a = PageAllocator(num_pages)
    return a, RadixCache(a, ps)


def test_radix_match_insert_and_split():
    a, rc = _cache()
    pages = a.alloc(3)
    tree_pages, node = rc.insert([1, 2, 3, 4, 5, 6], pages)
    assert tree_pages == pages
    # Whole-page match only: 5 tokens match 2 pages.
    got, n = rc.match_prefix([1, 2, 3, 4, 5])
    assert got == pages[:2]
    # A diverging request splits the edge after the common pages.
    got, _ = rc.match_prefix([1, 2, 9, 9])
    assert got == pages[:1]
    other = a.alloc(2)
    tree_pages, _ = rc.insert([1, 2, 9, 9], [other[0], other[1]])
    assert tree_pages == [pages[0], other[1]]  # the shared first page is the tree's
    assert rc.num_cached_pages == 4
    assert rc.hit_tokens == 4 + 2


def test_radix_evicts_lru_leaves_and_spares_locked_ones():
    a, rc = _cache(num_pages=9)
    p1 = a.alloc(2)
    _, n1 = rc.insert([1, 1, 2, 2], p1)
    p2 = a.alloc(2)
    _, n2 = rc.insert([3, 3, 4, 4], p2)
    rc.lock(n2)
    rc.match_prefix([1, 1, 2, 2])  # touch n1: still evictable, n2 is locked
    assert rc.evictable_pages() == 2
    free_before = a.num_free
    assert rc.evict(10) == 2
    assert a.num_free == free_before + 2
    assert rc.all_pages() == set(p2)
    rc.unlock(n2)
    assert rc.clear() == 2
    assert a.num_free == 8 and rc.num_cached_pages == 0


def test_radix_evicts_oldest_first():
    a, rc = _cache(num_pages=9)
    old = a.alloc(1)
    rc.insert([7, 7], old)
    new = a.alloc(1)
    rc.insert([8, 8], new)
    rc.match_prefix([8, 8])
    assert rc.evict(1) == 1
    assert rc.all_pages() == set(new)


def test_radix_split_keeps_locks():
    a, rc = _cache()
    p = a.alloc(3)
    _, node = rc.insert([1, 2, 3, 4, 5, 6], p)
    rc.lock(node)
    rc.match_prefix([1, 2, 3, 4, 0, 0])  # splits the locked edge
    assert rc.evict(10) == 0  # still all locked
    rc.unlock(node)
    assert rc.evict(10) == 3
