"""The KV pool's size where no memory plan is fitted: a CPU run without a simulated
device, or a fixed ``--kv-cache``. The engine sizes its pool with it, and ``headroom
plan --device cpu`` shows the same figure.
"""

from __future__ import annotations

import math

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import SettingRefused
from engine.common.units import MiB, fmt_bytes

# The CPU pool's default size: an anonymous map, resident only where written
# (engine.kvcache.pool), so an idle or short-context run costs little of it.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def unplanned_pages(config: EngineConfig, mc: ModelConfig, page_bytes: int) -> int:
    """Pages of the pool (the null page included) for ``--kv-cache`` bytes, else
    :data:`DEFAULT_CPU_KV_CACHE_BYTES`; without ``--kv-cache``, never fewer than one full
    context of the model (capped by ``--max-model-len``) needs, plus the null page.
    ``page_bytes``: one page's keys and values over all layers, in bytes.

    Raises:
        SettingRefused: ``--kv-cache`` holds less than one ``--min-context`` (capped by
            the model's context and ``--max-model-len``): a server that could answer
            only a few tokens is refused, with the size that fits.
    """
    budget = config.kv_cache if config.kv_cache is not None else DEFAULT_CPU_KV_CACHE_BYTES
    want_ctx = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
    if config.kv_cache is None:
        return max(budget // page_bytes, math.ceil(want_ctx / config.page_size) + 1)
    floor_ctx = min(config.min_context or 1, want_ctx)
    need = math.ceil(floor_ctx / config.page_size) + 1  # the null page too
    pages = budget // page_bytes
    if pages < need:
        held = max(pages - 1, 0) * config.page_size
        raise SettingRefused(
            f"--kv-cache {fmt_bytes(budget)} holds {held} tokens of this model ({fmt_bytes(page_bytes)} a page of "
            f"{config.page_size} tokens), less than one --min-context of {floor_ctx} tokens: give at least "
            f"--kv-cache {math.ceil(need * page_bytes / MiB)}MiB, or a smaller --min-context"
        )
    return pages
