"""The KV pool's size where no memory plan is fitted: a CPU run without a simulated
device, or a fixed ``--kv-cache``. The engine sizes its pool with it, and ``headroom
plan --device cpu`` shows the same figure.
"""

from __future__ import annotations

import math

from engine.common.config import EngineConfig, ModelConfig

# The CPU pool's default size: an anonymous map, resident only where written
# (engine.kvcache.pool), so an idle or short-context run costs little of it.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def unplanned_pages(config: EngineConfig, mc: ModelConfig, page_bytes: int) -> int:
    """Pages of the pool (the null page included) for ``--kv-cache`` bytes, else
    :data:`DEFAULT_CPU_KV_CACHE_BYTES`; without ``--kv-cache``, never fewer than one full
    context of the model (capped by ``--max-model-len``) needs, plus the null page.
    ``page_bytes``: one page's keys and values over all layers, in bytes."""
    budget = config.kv_cache if config.kv_cache is not None else DEFAULT_CPU_KV_CACHE_BYTES
    want_ctx = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
    floor = math.ceil(want_ctx / config.page_size) + 1 if config.kv_cache is None else 2
    return max(budget // page_bytes, floor)
