"""Renaming live pages to free ids below a cut: the bookkeeping half of moving KV pages.

A KV pool shrinks from the top, so pages at or above the cut that someone still holds
get new ids below it. This module decides the new ids and renames every reference (the
holders' page lists and the radix tree); the caller copies the keys and values
(:meth:`engine.kvcache.pool.KVPool.copy_pages`) with the mapping returned, before the
next forward reads them.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.radix import RadixCache


def relocate_below(
    high: list[int], cut: int, allocator: PageAllocator, page_lists: Iterable[list[int]], radix: RadixCache | None
) -> dict[int, int]:
    """Give each page of ``high`` (all at or above ``cut``) a free id below ``cut``.

    Every list of ``page_lists`` is rewritten in place and the radix tree renamed; the
    old ids go back to the allocator.

    Returns:
        ``{old page: new page}``, in the order of ``high``: copy the pages' contents
        accordingly.

    Raises:
        engine.kvcache.allocator.OutOfPages: fewer than ``len(high)`` free pages below
            ``cut`` (make room first).
    """
    if not high:
        return {}
    moved = dict(zip(high, allocator.alloc_below(len(high), cut), strict=True))
    for pages in page_lists:
        if any(p in moved for p in pages):
            pages[:] = [moved.get(p, p) for p in pages]
    if radix is not None:
        radix.remap(moved)
    allocator.free(high)
    return moved
