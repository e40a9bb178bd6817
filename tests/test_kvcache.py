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


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def test_cpu_pool_is_resident_only_where_written():
    """A CPU pool is zero-filled memory the kernel hands out on first touch: 512 MiB of
    pool cost a few MiB of RSS until pages are written, read back as zeros, and a resize
    keeps what was written."""
    import torch

    from engine.kvcache.pool import KVPool

    before = _rss_bytes()
    if before is None:
        pytest.skip("no /proc/self/status here")
    pool = KVPool(num_layers=8, num_pages=2048, page_size=16, num_kv_heads=8, head_dim=64,
                  dtype=torch.float32, device="cpu")  # 2 x 8 x 2048 x 16 x 8 x 64 x 4 B = 512 MiB
    assert _rss_bytes() - before < 64 << 20
    assert pool.k_buffers[3][-16:].abs().sum().item() == 0.0 and pool.v_buffers[7][:16].abs().sum().item() == 0.0
    pool.k_buffers[0][16:32] = 1.0
    pool.resize(1024)
    assert pool.num_pages == 1024 and pool.k_buffers[0][16:32].eq(1.0).all() and pool.k_buffers[0][32:].eq(0).all()
