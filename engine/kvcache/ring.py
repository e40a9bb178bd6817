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
follow live resizes of the pool: it is sized once, for ``max_running_requests`` rings
and the prefix cache's checkpoints.

Prefix cache: a cached prefix's pages hold the global layers only, and a prefix ending
at position ``E`` is only usable with the sliding layers' keys of positions
``E + 1 - window .. E - 1`` (what the next chunk's first token reads). Computing those
again is no way out: their own first tokens would miss the window before them, and so
on back to the start. So, as a hybrid model keeps its linear layers' states, a
*checkpoint* copies the ring's last :attr:`SlidingRing.checkpoint_pages` logical pages
before a page boundary aside (:meth:`RingPages.save`, into pages of the ring pool
reserved for checkpoints), the radix node ending there holds it, a match stops at the
deepest node holding one, and a request starting from it copies it into its own ring
(:meth:`RingPages.restore`); :mod:`engine.scheduler.prefix_rings` takes them.

Reference for the idea (read, not copied): SGLang's SWA token allocator and vLLM's
hybrid KV cache manager, which keep sliding layers' KV apart from the full layers'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.pool import KVPool


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

    @property
    def checkpoint_pages(self) -> int:
        """Pages of one prefix-cache checkpoint: the logical pages before a page boundary
        that a chunk starting there reads, ``ceil((window - 1) / page_size)`` (at least 1)."""
        return max(math.ceil((self.window - 1) / self.page_size), 1)

    def pool_pages(self, max_running_requests: int, checkpoints: int = 0) -> int:
        """Pages of the ring pool, the null page included: one ring per running request
        and ``checkpoints`` prefix-cache checkpoints."""
        return 1 + max_running_requests * self.pages + checkpoints * self.checkpoint_pages


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


def ring_row(ring: list[int], num_pages: int) -> np.ndarray:
    """The sliding layers' page table row of a request holding ``ring`` with
    ``num_pages`` logical pages, ``[num_pages]`` int64: entry ``j`` is
    ``ring[j % len(ring)]``."""
    return np.asarray(ring, dtype=np.int64)[np.arange(num_pages) % len(ring)]


class RingPages:
    """The ring pool's allocator, a whole ring at a time, and its prefix-cache checkpoints.

    Args:
        ring: the geometry.
        num_pages: ring pool pages, the null page included
            (:meth:`SlidingRing.pool_pages`); the last ``checkpoints *
            ring.checkpoint_pages`` of them hold checkpoints, the others rings.
        pool: the KV pool whose ring layers' pages checkpoints copy (None: no checkpoints).
        checkpoints: how many checkpoints the pool holds.

    Raises:
        ValueError: checkpoints without a pool, or more than the pages hold.
    """

    def __init__(self, ring: SlidingRing, num_pages: int, pool: KVPool | None = None, checkpoints: int = 0) -> None:
        self._base = num_pages - checkpoints * ring.checkpoint_pages  # the first checkpoint page
        if checkpoints and pool is None or self._base < 2:
            raise ValueError(f"{checkpoints} checkpoints of {ring.checkpoint_pages} pages in a ring pool of "
                             f"{num_pages} pages{' without a KV pool' if pool is None else ''}")
        self.ring = ring
        self.pool = pool
        self.allocator = PageAllocator(self._base)
        self._free_checkpoints = list(range(checkpoints))
        self.checkpoints = checkpoints

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

    def _pages(self, checkpoint: int, ring: list[int], end: int) -> tuple[list[int], list[int]]:
        """``(ring pages, checkpoint pages)`` of the logical pages a checkpoint at token
        ``end`` (a page boundary) keeps: the last ``checkpoint_pages`` before it."""
        c, ps = self.ring.checkpoint_pages, self.ring.page_size
        last = end // ps
        first = max(0, last - c)
        return ([ring[j % len(ring)] for j in range(first, last)],
                [self._base + checkpoint * c + i for i in range(last - first)])

    def save(self, ring: list[int], end: int) -> int | None:
        """Copy the sliding layers' keys and values before token ``end`` (a page
        boundary) of the request holding ``ring`` into a free checkpoint; returns it, or
        None when none is free (the caller frees one and asks again, or goes without)."""
        if not self._free_checkpoints:
            return None
        checkpoint = self._free_checkpoints.pop()
        src, dst = self._pages(checkpoint, ring, end)
        self.pool.copy_pages(src, dst, ring=True)
        return checkpoint

    def restore(self, checkpoint: int, ring: list[int], end: int) -> None:
        """Copy ``checkpoint`` (taken at token ``end``) into the ring ``ring`` of a request
        whose cached prefix ends there (the checkpoint stays)."""
        dst, src = self._pages(checkpoint, ring, end)
        self.pool.copy_pages(src, dst, ring=True)

    def free_checkpoint(self, checkpoint: int) -> None:
        """Give a checkpoint back. Raises ValueError for one that is not held."""
        if not 0 <= checkpoint < self.checkpoints or checkpoint in self._free_checkpoints:
            raise ValueError(f"ring checkpoint {checkpoint} is not held")
        self._free_checkpoints.append(checkpoint)
