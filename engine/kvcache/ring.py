"""Sliding-window layers' KV as a ring of pages per running request.

A ``"sliding_attention"`` layer (Gemma 3 / 4, gpt-oss) only ever reads the last
``window`` keys before each query, so it needs no slot for older tokens. Those layers
get buffers of their own in the pool (:class:`engine.kvcache.pool.KVPool`'s
``ring_layers``), paged like the others but over a small pool of *ring pages* with its
own allocator: each running request holds ``R`` of them (:attr:`SlidingRing.pages`),

    R = ceil((window + max_chunk) / page_size) + 1,

and its logical page ``j`` (the ``j``-th page of its context, as in the global layers'
page table) lives in ring page ``ring[j % R]``. Why that ``R``: while a prefill chunk of
``n <= max_chunk`` tokens starting at position ``p`` is written and read, the keys any
of its queries sees span positions ``p + 1 - window .. p + n - 1``, at most
``window + n - 1`` tokens, which touch at most ``ceil((window + n - 1) / page_size) + 1``
consecutive logical pages; ``R`` consecutive logical pages map to distinct ring pages,
so nothing live is overwritten. The ring's page table (:func:`ring_table`) names a ring
page for every logical page the request has: older entries alias live ones, and the
attention backends' window mask hides every position older than the window, so the
kernels read only live keys. No new attention kernel is needed.

The global layers keep the page table and pool they always had. The scheduler caps a
chunk at ``max_chunk`` and admits a request only when a whole ring is free; the ring
goes back when the request is preempted, finishes or is aborted. The ring pool does not
follow live resizes of the pool: it is sized once, for ``max_running_requests`` rings.

Reference for the idea (read, not copied): SGLang's SWA token allocator and vLLM's
hybrid KV cache manager, which keep sliding layers' KV apart from the full layers'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.kvcache.allocator import PageAllocator


@dataclass(frozen=True)
class SlidingRing:
    """The ring's geometry for one model and engine.

    Attributes:
        layers: the KV pool layers that slide (``kv_windows[i] > 0``).
        window: the largest of their windows, in tokens.
        max_chunk: the largest prefill chunk a request runs, in tokens.
        page_size: tokens per page (the pool's).
    """

    layers: tuple[int, ...]
    window: int
    max_chunk: int
    page_size: int

    @property
    def pages(self) -> int:
        """``R``, the ring pages one running request holds (see the module docstring)."""
        return math.ceil((self.window + self.max_chunk) / self.page_size) + 1

    def pool_pages(self, max_running_requests: int) -> int:
        """Pages of the ring pool, the null page included: one ring per running request."""
        return 1 + max_running_requests * self.pages


def sliding_ring(windows: tuple[int, ...], *, max_chunk: int, page_size: int) -> SlidingRing | None:
    """The ring for KV pool layers of ``windows`` (0: a global layer), or None when no
    layer slides or every layer does (the ring keeps the global layers' pool beside it;
    a model of sliding layers only keeps today's single pool).

    Raises:
        ValueError: ``max_chunk`` or ``page_size`` below 1.
    """
    if max_chunk < 1 or page_size < 1:
        raise ValueError(f"max_chunk and page_size must be >= 1, got {max_chunk} and {page_size}")
    sliding = tuple(i for i, w in enumerate(windows) if w)
    if not sliding or len(sliding) == len(windows):
        return None
    return SlidingRing(sliding, max(windows), max_chunk, page_size)


def ring_table(ring: list[int], num_pages: int) -> list[int]:
    """The sliding layers' page table row of a request holding ``ring`` with
    ``num_pages`` logical pages: entry ``j`` is ``ring[j % len(ring)]``."""
    r = len(ring)
    return [ring[j % r] for j in range(num_pages)]


class RingPages:
    """The ring pool's allocator, a whole ring at a time.

    Args:
        ring: the geometry.
        num_pages: ring pool pages, the null page included
            (:meth:`SlidingRing.pool_pages`).
    """

    def __init__(self, ring: SlidingRing, num_pages: int) -> None:
        self.ring = ring
        self.allocator = PageAllocator(num_pages)

    @property
    def free_rings(self) -> int:
        """Rings that can be handed out now."""
        return self.allocator.num_free // self.ring.pages

    def take(self) -> list[int]:
        """One ring of :attr:`SlidingRing.pages` pages.

        Raises:
            OutOfPages: no whole ring is free (nothing is taken then).
        """
        return self.allocator.alloc(self.ring.pages)

    def give(self, pages: list[int]) -> None:
        """Return a ring taken by :meth:`take`."""
        self.allocator.free(pages)
