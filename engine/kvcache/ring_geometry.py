"""The sliding-window ring's geometry (:mod:`engine.kvcache.ring` explains the ring): how
many ring pages a step, a request, the running requests and the prefix cache's
checkpoints take, and the ring pool's price beside the KV pool
(:class:`engine.memory.kv_fit.RingPrice`). Torch-free, so the settings checked before a
model loads (:mod:`engine.core.settings_fit`) price the ring as the engine holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.memory.kv_fit import RING_FLOOR_REQUESTS, RingPrice


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

    def pages_for(self, tokens: int) -> int:
        """Ring pages a step writing ``tokens`` tokens needs, ``ceil((window + tokens - 1)
        / page_size) + 1`` (see :mod:`engine.kvcache.ring`)."""
        return math.ceil((self.window + max(tokens, 1) - 1) / self.page_size) + 1

    @property
    def decode_pages(self) -> int:
        """``D``, the ring pages a request holds between steps and in decode
        (``pages_for(1)``)."""
        return self.pages_for(1)

    @property
    def pages(self) -> int:
        """The most ring pages one request holds: a step with a whole chunk,
        ``pages_for(max_chunk)``."""
        return self.pages_for(self.max_chunk)

    def rings_bound(self, requests: int) -> int:
        """Ring pages ``requests`` running requests hold at most, at any point of a step:
        ``requests x D + ceil(max_chunk / page_size) + min(requests, max_chunk)`` (see
        :mod:`engine.kvcache.ring`)."""
        if requests <= 0:
            return 0
        return (requests * self.decode_pages + math.ceil(self.max_chunk / self.page_size)
                + min(requests, self.max_chunk))

    @property
    def checkpoint_pages(self) -> int:
        """Pages of one prefix-cache checkpoint: the logical pages before a page boundary
        that a chunk starting there reads, ``ceil((window - 1) / page_size)`` (at least 1)."""
        return max(math.ceil((self.window - 1) / self.page_size), 1)

    def pool_pages(self, max_running_requests: int, checkpoints: int = 0, global_pages: int | None = None,
                   cap: int | None = None) -> int:
        """Pages of the ring pool, the null page included: the rings of
        ``max_running_requests`` (:meth:`rings_bound`) and ``checkpoints`` prefix-cache
        checkpoints, at most ``global_pages`` (the global pool's pages but its null page)
        and at most ``cap`` (the memory plan's choice, :mod:`engine.memory.kv_fit`; None:
        no such bound). See :mod:`engine.kvcache.ring` for why the rings never need more,
        and the scheduler waits for ring pages where the plan gave fewer."""
        pages = self.rings_bound(max_running_requests) + checkpoints * self.checkpoint_pages
        for most in (global_pages, cap):
            if most is not None:
                pages = min(pages, max(most, 1))
        return 1 + pages

    def price(self, page_bytes: int, max_running_requests: int, checkpoints: int) -> RingPrice:
        """The ring pool's price beside the KV pool (:class:`engine.memory.kv_fit.RingPrice`):
        ring pages of ``page_bytes`` (one page over the sliding layers, keys and values),
        their bound (the rings of ``max_running_requests`` and ``checkpoints`` prefix-cache
        checkpoints) and their floor (the rings of
        :data:`engine.memory.kv_fit.RING_FLOOR_REQUESTS` requests)."""
        return RingPrice(page_bytes=page_bytes,
                         full_cap=self.rings_bound(max_running_requests) + checkpoints * self.checkpoint_pages,
                         floor_cap=self.rings_bound(min(max_running_requests, RING_FLOOR_REQUESTS)))


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
