"""Free-list allocator of KV pages."""

from __future__ import annotations

import heapq


class OutOfPages(Exception):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Hands out page ids ``1 .. num_pages - 1`` (page 0 is the null page).

    Lowest ids go first (a min-heap), so a pool that later shrinks from the top finds
    its high pages free more often.
    """

    def __init__(self, num_pages: int) -> None:
        self._num_pages = num_pages
        self._free: list[int] = list(range(1, num_pages))  # sorted, hence a valid heap
        self._free_set = set(self._free)

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

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, lowest ids first.

        Raises:
            OutOfPages: fewer than ``n`` are free (nothing is taken then).
        """
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._free_set.difference_update(pages)
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
