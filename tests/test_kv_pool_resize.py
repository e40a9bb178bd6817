"""The page allocator's and the KV pool's own resize, without an engine: pages below the
cut kept and new ones zeroed, pages copied, never two whole pools held at once, and a
consistent pool after an out-of-memory error in the middle.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from engine.kvcache.allocator import OutOfPages, PageAllocator
from engine.kvcache.pool import KVPool

PAGE_SIZE = 4



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
