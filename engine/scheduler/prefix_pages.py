"""A request's computed pages handed to the prefix cache (the radix tree), so requests
arriving later, or this one after a preemption, reuse them instead of computing them
again."""

from __future__ import annotations

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.radix import RadixCache
from engine.scheduler.request import Request


def cache_full_pages(radix: RadixCache, allocator: PageAllocator, req: Request, page_size: int) -> None:
    """Insert ``req``'s full pages of computed tokens into ``radix``: where the tree
    already holds a page for the same tokens, the request takes the tree's page and its
    own copy is freed; the request then pins the new node (and unpins its old one), and
    its ``cached_len`` covers those pages."""
    full_pages = req.kv_len // page_size
    if full_pages * page_size <= req.cached_len:
        return
    tokens = req.all_ids[: full_pages * page_size]
    tree_pages, node = radix.insert(tokens, req.pages[:full_pages])
    start = req.cached_len // page_size
    duplicates = [p for p, t in zip(req.pages[start:full_pages], tree_pages[start:], strict=True) if p != t]
    if duplicates:
        allocator.free(duplicates)
    req.pages[start:full_pages] = tree_pages[start:]
    radix.lock(node)
    if req.last_node is not None:
        radix.unlock(req.last_node)
    req.last_node, req.cached_len = node, full_pages * page_size
