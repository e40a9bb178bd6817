"""Free-list allocator of KV pages."""

from __future__ import annotations

import heapq


class OutOfPages(Exception):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Hands out page ids ``1 .. num_pages - 1`` (page 0 is the null page).

    Lowest ids go first (a min-heap), so a pool that later shrinks from the top finds
    its high pages free more often, and the pages never handed out lie above a
    :attr:`high_water` mark.
    """

    def __init__(self, num_pages: int) -> None:
        self._num_pages = num_pages
        self._free: list[int] = list(range(1, num_pages))  # sorted, hence a valid heap
        self._free_set = set(self._free)
        self._high_water = 1

    @property
    def high_water(self) -> int:
        """One more than the highest page ever handed out (1 when none was; at most
        :attr:`num_pages`): the pages at or above it were never written, so they hold
        nothing a resize of the pool must copy (:meth:`engine.kvcache.pool.KVPool.resize`)."""
        return self._high_water

    @property
    def num_pages(self) -> int:
        """Pages managed, the null page included."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self._num_pages - 1

    def free_ids(self) -> list[int]:
        """The free pages, lowest first."""
        return sorted(self._free_set)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, lowest ids first.

        Raises:
            OutOfPages: fewer than ``n`` are free (nothing is taken then).
        """
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._free_set.difference_update(pages)
        if pages:
            self._high_water = max(self._high_water, pages[-1] + 1)  # popped lowest first
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the free list.

        Raises:
            ValueError: a page is out of range, the null page, or already free
                (then no page of the call is returned).
        """
        seen: set[int] = set()
        for p in pages:
            if p <= 0 or p >= self._num_pages:
                raise ValueError(f"page {p} is not a pool page (1..{self._num_pages - 1})")
            if p in self._free_set or p in seen:
                raise ValueError(f"page {p} freed twice")
            seen.add(p)
        for p in pages:
            heapq.heappush(self._free, p)
        self._free_set |= seen

    def resize(self, num_pages: int) -> None:
        """Manage ``num_pages`` pages from now on (the null page included).

        Growing adds pages ``old .. num_pages - 1`` to the free list. Shrinking removes
        pages ``num_pages ..`` from it; every one of them must be free (the engine moves
        or frees what lives there first).

        Raises:
            ValueError: ``num_pages < 2``, or shrinking while a page at or above
                ``num_pages`` is still handed out (nothing changes then).
        """
        if num_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (one is the null page), got {num_pages}")
        old = self._num_pages
        if num_pages > old:
            for p in range(old, num_pages):
                heapq.heappush(self._free, p)
            self._free_set.update(range(old, num_pages))
        elif num_pages < old:
            held = [p for p in range(num_pages, old) if p not in self._free_set]
            if held:
                shown = ", ".join(map(str, held[:8])) + (" ..." if len(held) > 8 else "")
                raise ValueError(
                    f"cannot shrink to {num_pages} pages: {len(held)} page(s) at or above it "
                    f"are in use ({shown})"
                )
            self._free = [p for p in self._free if p < num_pages]
            heapq.heapify(self._free)
            self._free_set.difference_update(range(num_pages, old))
            self._high_water = min(self._high_water, num_pages)
        self._num_pages = num_pages

    def free_below(self, limit: int) -> int:
        """Free pages with ids below ``limit``."""
        if limit >= self._num_pages:
            return len(self._free)
        return sum(1 for p in self._free if p < limit)

    def alloc_below(self, n: int, limit: int) -> list[int]:
        """Take ``n`` free pages with ids below ``limit``, lowest first.

        Raises:
            OutOfPages: fewer than ``n`` such pages are free (nothing is taken then).
        """
        have = self.free_below(limit)
        if n > have:
            raise OutOfPages(f"asked for {n} pages below {limit}, {have} free there")
        return self.alloc(n)  # lowest ids first: all of them lie below the limit
