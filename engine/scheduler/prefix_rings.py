"""The prefix cache of a model whose sliding-window layers keep only their window
(:mod:`engine.kvcache.ring`): checkpoints of the ring beside the cached pages.

A cached prefix's pages hold the global layers only; the sliding layers' keys of the
window before its end are kept aside at page boundaries, as a hybrid model keeps its
linear layers' states (:mod:`engine.scheduler.prefix_states`, whose checkpoints are
taken and restored at the same points: each prefill chunk's end, and each page boundary
of a decode, the request's latest replacing its previous), and a match stops at the
deepest node holding one. Reference for the idea (read, not copied): SGLang's SWA radix
cache and vLLM's hybrid KV cache manager, which keep the sliding-window blocks of a hit's
last window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler.prefix_states import PrefixStates

if TYPE_CHECKING:
    from engine.kvcache.radix import RadixCache
    from engine.kvcache.ring import RingPages
    from engine.scheduler.request import Request


class PrefixRings(PrefixStates):
    """Ring checkpoints in the radix cache, for one scheduler.

    Args:
        rings: the ring pool (with checkpoints).
        radix: the prefix cache, made with ``release_state=rings.free_checkpoint``.
        page_size: tokens per KV page.
    """

    def __init__(self, rings: RingPages, radix: RadixCache, page_size: int) -> None:
        super().__init__(rings, radix, page_size)  # type: ignore[arg-type]

    def _holds(self, req: Request) -> bool:
        return bool(req.ring)

    def _save(self, req: Request) -> int | None:
        return self.states.save(req.ring, req.kv_len)

    def _restore(self, checkpoint: int, req: Request) -> None:
        self.states.restore(checkpoint, req.ring, req.kv_len)
