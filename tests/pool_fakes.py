"""An engine's counters and its pool as the worker reports them, for the wiring tests
that need no engine (``test_wiring_units.py``, ``test_vram_watcher.py``,
``test_replan_events.py``).
"""

from __future__ import annotations

from service_harness import engine_stats

from engine.common.units import GiB, MiB
from engine.wire import ipc

STATS = engine_stats(free_pages=100, total_pages=100, cached_pages=7)


def pool_stats(
    pages: int, *, min_pages: int, activation_bytes_per_token: int, max_context_tokens: int
) -> ipc.PoolStats:
    """A worker's pool at its plan: ``pages`` pages of 1 MiB (the null page among them, so
    one fewer free), a 2048-token prefill chunk (256 at the least), an empty prefix
    cache, 1 GiB besides the pool."""
    return ipc.PoolStats(
        pages=pages,
        planned_pages=pages,
        min_pages=min_pages,
        page_bytes=MiB,
        pool_bytes=pages * MiB,
        prefill_chunk=2048,
        planned_prefill_chunk=2048,
        min_prefill_chunk=256,
        activation_bytes_per_token=activation_bytes_per_token,
        free_pages=pages - 1,
        cached_pages=0,
        max_context_tokens=max_context_tokens,
        fixed_bytes=GiB,
    )
