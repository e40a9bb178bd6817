"""The prefix cache of a hybrid linear-attention model: the linear layers' states after a
cached prefix, kept beside its pages.

A Gated DeltaNet layer's state after token ``t`` cannot be rebuilt from the KV pages of
the attention layers, so a cached prefix is only usable up to a point where the states
were copied aside (a checkpoint slot of :class:`engine.kvcache.state_pool.StatePool`,
held by the radix node that ends there: :class:`engine.kvcache.radix.RadixCache`).
Checkpoints are taken where a request's computed tokens end on a page boundary:

- at the end of each prefill chunk, which for these models ends on a page boundary where
  it can (:meth:`PrefixStates.chunk_tokens`: the tail of a prompt after its last whole
  page runs as a chunk of its own), so a long prompt leaves a checkpoint every chunk and
  one at its last whole page;
- during decode, at each page boundary, replacing the request's previous decode
  checkpoint: when it finishes, the states after its last whole page of prompt and answer
  stay, which is what an agent's next turn (the same conversation plus a new message)
  starts from.

A new request restores the deepest checkpoint its prompt matches into its own slot
(:meth:`PrefixStates.restore`) and computes from there. The idea is that of SGLang's
and vLLM's prefix caching for Mamba-style hybrids (states kept at cache boundaries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kvcache.radix import RadixCache, RadixNode
    from engine.kvcache.state_pool import StatePool
    from engine.scheduler.request import Request


class PrefixStates:
    """Checkpoints of a hybrid model's states in the radix cache, for one scheduler.

    Args:
        states: the state pool (with checkpoint slots).
        radix: the prefix cache, made with ``release_state=states.free_checkpoint``.
        page_size: tokens per KV page.
    """

    def __init__(self, states: StatePool, radix: RadixCache, page_size: int) -> None:
        self.states = states
        self.radix = radix
        self.page_size = page_size
        # The node holding each running request's latest decode checkpoint, by request id.
        self._decode_nodes: dict[str, RadixNode] = {}
        self.restored = 0  # requests that started from a checkpoint
        self.saved = 0  # checkpoints taken

    def restore(self, req: Request, node: RadixNode) -> None:
        """Start ``req`` (holding its state slot) from the states at ``node``, the end of
        the prefix it matched (nothing to do for the empty prefix)."""
        if node.state is not None:
            self._restore(node.state, req)
            self.restored += 1

    def chunk_tokens(self, req: Request, n: int) -> int:
        """A prefill chunk of ``n`` tokens from ``req.kv_len``, cut to end on a page
        boundary where one lies inside it."""
        end = req.kv_len + n
        aligned = end - end % self.page_size
        return aligned - req.kv_len if aligned > req.kv_len else n

    def keep(self, req: Request, cache_prefix: Callable[[Request], None], decoding: bool) -> None:
        """After a step of ``req`` that ran: where its computed tokens end on a page
        boundary, hand its pages to the prefix cache (``cache_prefix``) and keep a copy of
        its states at the node ending there. ``decoding``: the step was a decode step
        (its checkpoint replaces the request's previous decode checkpoint)."""
        if req.kv_len == 0 or req.kv_len % self.page_size or not self._holds(req):
            return
        cache_prefix(req)
        node = req.last_node
        if node is None or node.state is not None:
            return
        checkpoint = self._save(req)
        if checkpoint is None and self.radix.drop_lru_state():
            checkpoint = self._save(req)
        if checkpoint is None:
            return
        if not self.radix.attach_state(node, checkpoint):
            self.states.free_checkpoint(checkpoint)
            return
        self.saved += 1
        if decoding:
            previous = self._decode_nodes.get(req.request_id)
            if previous is not None and previous is not node:
                self.radix.drop_state(previous)
            self._decode_nodes[req.request_id] = node

    # What a checkpoint copies, for the state pool; engine.scheduler.prefix_rings
    # copies a sliding-window ring instead.
    def _holds(self, req: Request) -> bool:
        return req.state_slot is not None

    def _save(self, req: Request) -> int | None:
        return self.states.save(req.state_slot)

    def _restore(self, checkpoint: int, req: Request) -> None:
        self.states.restore(checkpoint, req.state_slot)

    def forget(self, req: Request) -> None:
        """``req`` ended or left the running set: its last decode checkpoint stays cached,
        no longer replaced by later ones."""
        self._decode_nodes.pop(req.request_id, None)
