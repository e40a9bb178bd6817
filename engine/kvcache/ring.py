"""Sliding-window layers' KV as a ring of pages per running request.

A ``"sliding_attention"`` layer (Gemma 3 / 4, gpt-oss) only ever reads the last
``window`` keys before each query, so it needs no slot for older tokens. Those layers
get buffers of their own in the pool (:class:`engine.kvcache.pool.KVPool`'s
``ring_layers``), paged like the others but over a small pool of *ring pages* with its
own allocator. A running request holds a ring of ``L`` of them, and its logical page
``j`` (the ``j``-th page of its context, as in the global layers' page table) lives in
ring page ``ring[j % L]``. The ring's page table (:func:`ring_row`) names a ring page
for every logical page the request has: older entries alias live ones, and the
attention backends' window mask hides every position older than the window, so the
kernels read only live keys. No new attention kernel is needed.

A ring's size follows its step (:meth:`RingPages.fit`): a step writing ``n`` tokens
from position ``p`` reads keys of positions ``p + 1 - window .. p + n - 1``, at most
``window + n - 1`` tokens, which touch at most

    pages_for(n) = ceil((window + n - 1) / page_size) + 1

consecutive logical pages (:meth:`SlidingRing.pages_for`); ``L`` consecutive logical
pages map to distinct ring pages, so a ring of ``min(context pages, pages_for(n))``
overwrites nothing live. So a prefill chunk of ``n`` tokens runs with a ring of
``pages_for(n)`` pages, and once the step is done the ring goes back to the decode size
``D = pages_for(1)`` (:meth:`RingPages.settle`). Changing ``L`` copies nothing: the live
logical pages (the last ones before the next token, at most ``min(L, L')``) are
consecutive, so their residues modulo the new size are distinct, and the new ring is
the same physical pages in new places, plus fresh ones or minus spare ones. While a
context is shorter than its ring, ``j % L = j`` and the ring grows by appending, as the
global pages do.

The ring pool (:meth:`SlidingRing.pool_pages`) holds what ``M`` running requests can
hold at once: outside a step each holds at most ``D``, and in a step the items of a
chunk budget of ``C`` tokens (``n_i`` each, ``sum n_i <= C``) hold ``pages_for(n_i) -
D <= ceil((n_i - 1) / page_size)`` more, so

    M x D + ceil(C / page_size) + min(M, C)

pages cover every step (:meth:`SlidingRing.rings_bound`), and never more than the
global pool's pages (each ring holds at most its own context's pages; the prefix
cache's checkpoints take pages of the same pool, ``checkpoints x checkpoint_pages``
more). It cannot run out before the global pool does except where two running requests
share cached prefix pages (each holds ring pages for them), or where the memory plan
gave it fewer pages than the bound so that the global pool holds the wanted context
(:mod:`engine.memory.kv_fit`): the scheduler then waits or preempts as for global
pages, and checks that the ring ran short only so (anything else is a bug). So the sliding layers never hold more pages than the global layers,
and at contexts past ``D`` pages far fewer: at Gemma 3's window of 1,024 tokens, pages
of 16 and chunks of 2,048, ``D`` is 65 pages where a ring sized for the chunk too
would be 193. The ring pool follows live resizes of the global pool, by the plan's rule
(:class:`engine.memory.kv_fit.RingRule`; :func:`engine.scheduler.resize.shrink_rings`
frees its pages above a cut, moving live ones, dropping checkpoints, preempting); one
left below its bound there waits as for global pages.

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

import numpy as np

from engine.kvcache.allocator import PageAllocator
from engine.kvcache.pool import KVPool
from engine.kvcache.ring_geometry import SlidingRing, sliding_ring

__all__ = ["RingPages", "SlidingRing", "ring_row", "sliding_ring"]


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

    def target(self, num_pages: int, tokens: int) -> int:
        """The ring size of a request whose context covers ``num_pages`` logical pages
        once a step writing ``tokens`` tokens is done: ``min(num_pages,
        pages_for(tokens))``."""
        return min(num_pages, self.ring.pages_for(tokens))

    def wanted(self, ring: list[int], num_pages: int, tokens: int) -> int:
        """Ring pages :meth:`fit` takes from the pool for that step (0 when the ring is
        large enough already)."""
        return max(self.target(num_pages, tokens) - len(ring), 0)

    def reach(self, ring: list[int], kv_len: int) -> int | None:
        """The most tokens the context of a request holding ``ring`` (``kv_len`` tokens
        computed) can reach in its next step with the ring pages free now or held by
        checkpoints; None: any number (a whole chunk fits). A step of ``n`` tokens fits
        in ``a`` pages while its context's pages or its ring, ``pages_for(n)``, do."""
        a = len(ring) + self.allocator.num_free + self.checkpoint_pages_held
        if a >= self.ring.pages:
            return None
        p = self.ring.page_size
        by_ring = (a - 1) * p - self.ring.window + 1  # pages_for(n) <= a
        return max(a * p, kv_len + by_ring)

    def fit(self, ring: list[int], num_pages: int, kv_len: int, tokens: int) -> None:
        """Resize ``ring`` in place for a step writing ``tokens`` tokens after the
        ``kv_len`` computed ones, the context then covering ``num_pages`` logical pages
        (:meth:`target` pages), keeping every live page where the new size maps it.

        Raises:
            OutOfPages: too few ring pages are free (the ring is as before then).
        """
        self._resize(ring, self.target(num_pages, tokens), kv_len)

    def settle(self, ring: list[int], num_pages: int, kv_len: int) -> None:
        """Resize ``ring`` in place to its size between steps, ``min(num_pages, D)``, after
        a step (or one undone): it keeps the pages the next step's window reads and gives
        the rest back. Never raises: it only shrinks."""
        self._resize(ring, min(len(ring), self.target(num_pages, 1)), kv_len)

    def _resize(self, ring: list[int], size: int, kv_len: int) -> None:
        """Make ``ring`` ``size`` pages holding the last ``min(len(ring), size)`` logical
        pages before token ``kv_len`` (those computed, the last one partly) where the new
        size maps them. Copies nothing (see the module docstring); allocates before it
        changes anything."""
        old = len(ring)
        if size == old:
            return
        before = -(-kv_len // self.ring.page_size)
        # Where no page wrapped (old and size both cover ``before``) this keeps ring[:before]
        # in place and appends or cuts the tail, as the global pages grow and shrink.
        keep = min(old, size, before)
        placed: list[int | None] = [None] * size
        for j in range(before - keep, before):
            placed[j % size] = ring[j % old]
        taken = set(p for p in placed if p is not None)
        spare = [p for p in ring if p not in taken]
        empty = size - keep
        fresh = self.allocator.alloc(empty - len(spare)) if empty > len(spare) else []
        fill = iter(spare[:empty] + fresh)
        ring[:] = [p if p is not None else next(fill) for p in placed]
        if len(spare) > empty:
            self.allocator.free(spare[empty:])

    def give(self, pages: list[int]) -> None:
        """Return every page of a ring."""
        self.allocator.free(pages)

    def checkpoint_lists(self) -> list[list[int]]:
        """The pages of each checkpoint held, as the lists this pool keeps (a live shrink
        renames pages in them in place: :func:`engine.scheduler.resize.shrink_rings`)."""
        return list(self._held.values())

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
