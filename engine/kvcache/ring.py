"""Sliding-window layers' KV as a ring of pages per running request.

A ``"sliding_attention"`` layer (Gemma 3 / 4, gpt-oss) only ever reads the last
``window`` keys before each query, so it needs no slot for older tokens. Those layers
get buffers of their own in the pool (:class:`engine.kvcache.pool.KVPool`'s
``ring_layers``), paged like the others but over a small pool of *ring pages* with its
own allocator: each running request holds at most ``R`` of them (:attr:`SlidingRing.pages`),

    R = ceil((window + max_chunk) / page_size) + 1,

and its logical page ``j`` (the ``j``-th page of its context, as in the global layers'
page table) lives in ring page ``ring[j % len(ring)]``. Why that ``R``: while a prefill
chunk of ``n <= max_chunk`` tokens starting at position ``p`` is written and read, the
keys any of its queries sees span positions ``p + 1 - window .. p + n - 1``, at most
``window + n - 1`` tokens, which touch at most ``ceil((window + n - 1) / page_size) + 1``
consecutive logical pages; ``R`` consecutive logical pages map to distinct ring pages,
so nothing live is overwritten. The ring's page table (:func:`ring_row`) names a ring
page for every logical page the request has: older entries alias live ones, and the
attention backends' window mask hides every position older than the window, so the
kernels read only live keys. No new attention kernel is needed.

A ring grows lazily, as the request's global pages do (:meth:`RingPages.grow`, at the
same points of the scheduler): it holds ``min(pages of its context, R)`` ring pages, so
while it is shorter than ``R`` its logical page ``j`` is its ``j``-th ring page, and once
it reaches ``R`` the pages are reused in ring order. A short request holds no more ring
pages than global pages. The ring pool holds

    min(max_running_requests * R, global pool pages)

ring pages and its null page (:meth:`SlidingRing.pool_pages`; the prefix cache's
checkpoints take pages of the same pool, up to ``checkpoints x checkpoint_pages`` more
where the global pool is larger). It cannot run out before the global pool does: the
running requests (at most ``max_running_requests``) each hold ``min(own pages, R)`` ring
pages, and without two of them sharing a cached prefix page their pages are distinct
pages of the global pool, so together they hold at most ``min(running * R, global pages
in use)``; a ring that needs pages drops checkpoints first, least recently used first,
as the radix cache evicts pages. Two requests sharing a cached prefix each hold ring
pages for it, so there the ring pool can be the short one; the scheduler then waits or
preempts as for global pages (and checks that the ring ran short only so: anything else
is a bug). So the sliding layers never hold more pages than the global layers, and at
contexts past ``R`` pages far fewer. The ring pool does not follow live resizes of the
global pool: a shrink leaves it larger than the bound needs (safe; its memory was
planned at the start), and a grow past the start's pages leaves a pool that may run
short first, where the scheduler waits as for global pages.

Prefix cache: a cached prefix's pages hold the global layers only, and a prefix ending
at position ``E`` is only usable with the sliding layers' keys of positions
``E + 1 - window .. E - 1`` (what the next chunk's first token reads). Computing those
again is no way out: their own first tokens would miss the window before them, and so
on back to the start. So, as a hybrid model keeps its linear layers' states, a
*checkpoint* copies the ring's last :attr:`SlidingRing.checkpoint_pages` logical pages
before a page boundary aside (:meth:`RingPages.save`, into pages of the ring pool), the
radix node ending there holds it, a match stops at the
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

    def pool_pages(self, max_running_requests: int, checkpoints: int = 0, global_pages: int | None = None) -> int:
        """Pages of the ring pool, the null page included: one ring of ``R`` pages per
        running request and ``checkpoints`` prefix-cache checkpoints, at most
        ``global_pages`` (the global pool's pages but its null page; None: no such
        bound). See the module docstring for why the rings never need more."""
        pages = max_running_requests * self.pages + checkpoints * self.checkpoint_pages
        if global_pages is not None:
            pages = min(pages, max(global_pages, 1))
        return 1 + pages


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
    """The ring pool's allocator, growing each request's ring lazily, and its prefix-cache
    checkpoints, which take their pages from the same allocator.

    Args:
        ring: the geometry.
        num_pages: ring pool pages, the null page included
            (:meth:`SlidingRing.pool_pages`).
        pool: the KV pool whose ring layers' pages checkpoints copy (None: no checkpoints).
        checkpoints: how many checkpoints the pool holds at most.

    Raises:
        ValueError: checkpoints without a pool, or fewer than 2 pages.
    """

    def __init__(self, ring: SlidingRing, num_pages: int, pool: KVPool | None = None, checkpoints: int = 0) -> None:
        if checkpoints and pool is None or num_pages < 2:
            raise ValueError(f"{checkpoints} checkpoints in a ring pool of {num_pages} pages"
                             f"{' without a KV pool' if pool is None else ''}: it needs 2 pages or more")
        self.ring = ring
        self.pool = pool
        self.allocator = PageAllocator(num_pages)
        self._free_checkpoints = list(range(checkpoints))
        self._held: dict[int, list[int]] = {}  # a checkpoint's pages
        self.checkpoints = checkpoints

    @property
    def checkpoint_pages_held(self) -> int:
        """Ring pool pages the checkpoints hold now."""
        return sum(len(p) for p in self._held.values())

    def wanted(self, ring: list[int], num_pages: int) -> int:
        """Ring pages a request holding ``ring`` takes to cover ``num_pages`` logical
        pages: ``min(num_pages, R) - len(ring)`` (0 when it holds them already)."""
        return max(min(num_pages, self.ring.pages) - len(ring), 0)

    def reach(self, ring: list[int]) -> int | None:
        """The most logical pages a request holding ``ring`` can cover with the ring
        pages free now or held by checkpoints; None: any number (it can reach ``R``)."""
        most = len(ring) + self.allocator.num_free + self.checkpoint_pages_held
        return None if most >= self.ring.pages else most

    def grow(self, ring: list[int], num_pages: int) -> list[int]:
        """Extend ``ring`` in place to cover ``num_pages`` logical pages (``min(num_pages,
        R)`` ring pages); returns the pages added.

        Raises:
            OutOfPages: too few ring pages are free (nothing is taken then).
        """
        need = self.wanted(ring, num_pages)
        if need == 0:
            return []
        pages = self.allocator.alloc(need)
        ring.extend(pages)
        return pages

    def trim(self, ring: list[int], num_pages: int) -> None:
        """Shrink ``ring`` in place to ``min(num_pages, R)`` pages, giving the last back
        (a step's growth undone)."""
        keep = min(num_pages, self.ring.pages)
        if len(ring) > keep:
            self.allocator.free(ring[keep:])
            del ring[keep:]

    def give(self, pages: list[int]) -> None:
        """Return every page of a ring."""
        self.allocator.free(pages)

    def _logical(self, ring: list[int], end: int) -> list[int]:
        """The ring pages of the logical pages a checkpoint at token ``end`` (a page
        boundary) keeps: the last ``checkpoint_pages`` before it."""
        last = end // self.ring.page_size
        return [ring[j % len(ring)] for j in range(max(0, last - self.ring.checkpoint_pages), last)]

    def save(self, ring: list[int], end: int) -> int | None:
        """Copy the sliding layers' keys and values before token ``end`` (a page
        boundary) of the request holding ``ring`` into a new checkpoint; returns it, or
        None when none is free or the pool lacks its pages (the caller frees one and
        asks again, or goes without). A ring that grows frees checkpoints first
        (:func:`engine.scheduler.ring_growth.grow_ring`)."""
        src = self._logical(ring, end)
        if not self._free_checkpoints or self.allocator.num_free < len(src):
            return None
        checkpoint = self._free_checkpoints.pop()
        self._held[checkpoint] = dst = self.allocator.alloc(len(src))
        self.pool.copy_pages(src, dst, ring=True)
        return checkpoint

    def restore(self, checkpoint: int, ring: list[int], end: int) -> None:
        """Copy ``checkpoint`` (taken at token ``end``) into the ring ``ring`` of a request
        whose cached prefix ends there (the checkpoint stays)."""
        self.pool.copy_pages(self._held[checkpoint], self._logical(ring, end), ring=True)

    def free_checkpoint(self, checkpoint: int) -> None:
        """Give a checkpoint and its pages back. Raises ValueError for one that is not held."""
        if checkpoint not in self._held:
            raise ValueError(f"ring checkpoint {checkpoint} is not held")
        self.allocator.free(self._held.pop(checkpoint))
        self._free_checkpoints.append(checkpoint)
