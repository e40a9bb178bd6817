"""Radix prefix cache over KV pages.

A tree whose edges are runs of token ids, a whole number of pages long, and whose
nodes own the pages holding those tokens' keys and values. A new request reuses the
longest cached prefix (whole pages only) instead of recomputing it. Nodes referenced by
a running request are locked; unlocked leaves are evicted least recently used first
when the pool runs short.

The idea is SGLang's RadixAttention (Zheng et al., 2023, "Efficiently Programming Large
Language Models using SGLang"); this version works at page granularity so it shares the
page allocator with everything else.

A hybrid linear-attention model also needs its linear layers' states after a prefix,
which its pages cannot give back: a node may hold a ``state`` (a checkpoint slot of
:class:`engine.kvcache.state_pool.StatePool`, the states after the node's last token),
and with ``release_state`` set a match stops at the deepest node on its path that holds
one. Checkpoints go back through ``release_state`` when their node is evicted, or the
least recently used one when the pool wants a slot (:meth:`RadixCache.drop_lru_state`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from engine.kvcache.allocator import PageAllocator

_clock = itertools.count()


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "state")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None) -> None:
        self.state: int | None = None  # a checkpoint of the states after this node's tokens
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)


class RadixCache:
    """Prefix cache that owns the pages of the tokens it holds.

    Args:
        allocator: the page allocator; evicted pages go back to it.
        page_size: tokens per page.
        release_state: for a hybrid model, the call that gives a node's state
            checkpoint back (matches then end at nodes holding one); None otherwise.

    Counters: ``hit_tokens`` / ``lookup_tokens`` over all :meth:`match_prefix` calls.
    """

    def __init__(self, allocator: PageAllocator, page_size: int,
                 release_state: Callable[[int], None] | None = None) -> None:
        self.release_state = release_state
        self.allocator = allocator
        self.page_size = page_size
        self.root = RadixNode((), [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.num_cached_pages = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    # -- lookup -------------------------------------------------------------------------

    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], RadixNode]:
        """Longest cached prefix of ``tokens`` in whole pages.

        With ``release_state`` set, the prefix ends at the deepest node on the path that
        holds a state checkpoint (the root, holding none, stands for the empty prefix).

        Returns:
            ``(pages, node)``: the pages holding the prefix (``len(pages) * page_size``
            tokens) and the deepest node covering it, to :meth:`lock` while in use.
        """
        ps = self.page_size
        usable = len(tokens) - len(tokens) % ps
        node, pages, pos = self.root, [], 0
        node.last_access = next(_clock)
        best = (0, node)  # (pages, node) of the deepest usable end so far
        while pos < usable:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            child = self._shared_part(child, tokens, pos)
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
            node.last_access = next(_clock)
            if self.release_state is None or node.state is not None:
                best = (len(pages), node)
        del pages[best[0]:]
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(pages) * ps
        return pages, best[1]

    def _shared_part(self, child: RadixNode, tokens: Sequence[int], pos: int) -> RadixNode:
        """``child``, whose first page matches ``tokens[pos:]``, cut to the whole pages
        they share (:meth:`_split` where they part; ``child`` itself when all match)."""
        key, ps, n = child.key, self.page_size, 0
        while n * ps < len(key) and pos + (n + 1) * ps <= len(tokens):
            if key[n * ps : (n + 1) * ps] != tuple(tokens[pos + n * ps : pos + (n + 1) * ps]):
                break
            n += 1
        return self._split(child, n) if n * ps < len(key) else child

    def _split(self, child: RadixNode, n_pages: int) -> RadixNode:
        """Cut ``child``'s edge after ``n_pages`` pages; returns the new upper node."""
        cut = n_pages * self.page_size
        upper = RadixNode(child.key[:cut], child.pages[:n_pages], child.parent)
        upper.lock_ref = child.lock_ref
        assert child.parent is not None
        child.parent.children[child.key[: self.page_size]] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[n_pages:], upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    # -- insertion ----------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[list[int], RadixNode]:
        """Add ``tokens`` (a whole number of pages) held in ``pages``.

        Where the tree already holds a prefix of ``tokens``, its pages win: the caller's
        pages for that part are duplicates, and the caller must free those that differ
        and use the returned ones.

        Returns:
            ``(tree_pages, node)``: the tree's pages for all of ``tokens`` and the node
            that ends at them.

        Raises:
            ValueError: ``len(tokens)`` is not ``len(pages) * page_size``.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {ps}")
        node, pos, out = self.root, 0, []
        while pos < len(tokens):
            node.last_access = next(_clock)
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                new = RadixNode(tuple(tokens[pos:]), list(pages[pos // ps :]), node)
                node.children[new.key[:ps]] = new
                self.num_cached_pages += len(new.pages)
                out.extend(new.pages)
                return out, new
            child = self._shared_part(child, tokens, pos)
            out.extend(child.pages)
            pos += len(child.key)
            node = child
        node.last_access = next(_clock)
        return out, node

    # -- locking and eviction -----------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix node unlocked more often than locked"
            node = node.parent

    def evictable_pages(self) -> int:
        """Pages held by unlocked nodes (all of them can be evicted, leaves first)."""
        total, stack = 0, [self.root]
        while stack:
            n = stack.pop()
            if n.lock_ref == 0:
                total += len(n.pages)
            stack.extend(n.children.values())
        return total

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages from unlocked leaves, least recently used first.

        Returns the number of pages freed (less when not enough are evictable).
        """
        leaves = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self._release(leaf)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.num_cached_pages -= len(leaf.pages)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def evict_at_or_above(self, limit: int) -> int:
        """Evict every unlocked node that holds a page ``>= limit``, with its subtree
        (unlocked too: a lock pins a node's ancestors, so nothing below an unlocked node
        is locked). Used before the pool shrinks to ``limit`` pages: cached pages above
        the cut go instead of being moved. Returns the number of pages freed."""
        freed, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref == 0 and any(p >= limit for p in node.pages):
                freed += self._drop_subtree(node)
            else:
                stack.extend(node.children.values())
        return freed

    def _drop_subtree(self, node: RadixNode) -> int:
        pages, stack = [], [node]
        while stack:
            n = stack.pop()
            self._release(n)
            pages.extend(n.pages)
            stack.extend(n.children.values())
        assert node.parent is not None
        del node.parent.children[node.key[: self.page_size]]
        node.parent = None
        self.allocator.free(pages)
        self.num_cached_pages -= len(pages)
        return len(pages)

    # -- state checkpoints (hybrid models) ------------------------------------------------

    def attach_state(self, node: RadixNode, checkpoint: int) -> bool:
        """Keep ``checkpoint`` (the states after ``node``'s last token) at ``node``; False,
        keeping nothing, when ``node`` is the root or already holds one (the caller gives
        ``checkpoint`` back)."""
        if node is self.root or node.state is not None:
            return False
        node.state = checkpoint
        return True

    def drop_state(self, node: RadixNode) -> None:
        """Give back ``node``'s checkpoint, if it holds one (its pages stay cached)."""
        self._release(node)

    def drop_lru_state(self) -> bool:
        """Give back the checkpoint of the least recently used node holding one (its pages
        stay cached); False when no node holds one."""
        held, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.state is not None:
                held.append(n)
            stack.extend(n.children.values())
        if not held:
            return False
        self._release(min(held, key=lambda n: n.last_access))
        return True

    def _release(self, node: RadixNode) -> None:
        if node.state is not None and self.release_state is not None:
            self.release_state(node.state)
        node.state = None

    def remap(self, moved: dict[int, int]) -> None:
        """Rename pages after their contents were copied elsewhere: every node's page
        ``p`` becomes ``moved[p]`` (pages not in ``moved`` stay)."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            if any(p in moved for p in n.pages):
                n.pages = [moved.get(p, p) for p in n.pages]
            stack.extend(n.children.values())

    def clear(self) -> int:
        """Evict everything unlocked; returns pages freed."""
        return self.evict(self.num_cached_pages)

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    def all_pages(self) -> set[int]:
        """Every page the tree holds (for checks and tests)."""
        out, stack = set(), [self.root]
        while stack:
            n = stack.pop()
            out.update(n.pages)
            stack.extend(n.children.values())
        return out
