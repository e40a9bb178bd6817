"""The KV pool's size where no memory plan is fitted: a CPU run without a simulated
device, or a fixed ``--kv-cache`` or ``--num-pages``. The engine sizes its pool with it,
and ``headroom plan --device cpu`` shows the same figure; a fixed pool that holds less
than one ``--min-context`` is refused (``--kv-cache``) or warned about (``--num-pages``,
which small test pools use), and one larger than the host's available memory is
refused where the host holds it.
"""

from __future__ import annotations

import math

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import SettingRefused
from engine.common.units import MiB, fmt_bytes
from engine.memory.host import host_memory

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
    if config.kv_cache is None:
        return max(budget // page_bytes, math.ceil(_wanted_context(config, mc) / config.page_size) + 1)
    floor_ctx, need = floor_pages(config, mc)
    pages = budget // page_bytes
    if pages < need:
        held = max(pages - 1, 0) * config.page_size
        raise SettingRefused(
            f"--kv-cache {fmt_bytes(budget)} holds {held} tokens of this model ({fmt_bytes(page_bytes)} a page of "
            f"{config.page_size} tokens), less than one --min-context of {floor_ctx} tokens: give at least "
            f"--kv-cache {math.ceil(need * page_bytes / MiB)}MiB, or a smaller --min-context"
        )
    return pages


def _wanted_context(config: EngineConfig, mc: ModelConfig) -> int:
    """The model's context capped by ``--max-model-len``, in tokens."""
    return min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)


def floor_pages(config: EngineConfig, mc: ModelConfig) -> tuple[int, int]:
    """``(tokens, pages)``: the floor a fixed pool must hold, one request of
    ``--min-context`` capped by the model's context and ``--max-model-len``, and the
    pool's pages that hold it, the null page included."""
    floor_ctx = min(config.min_context or 1, _wanted_context(config, mc))
    return floor_ctx, math.ceil(floor_ctx / config.page_size) + 1


def short_pool_warning(config: EngineConfig, mc: ModelConfig) -> str | None:
    """What to say when ``--num-pages`` holds less than one ``--min-context`` (see
    :func:`floor_pages`), else None. Not refused, as ``--kv-cache`` is: small fixed
    pools serve short requests, and a longer one is refused at once (400
    ``context_length_exceeded``), the pool being the engine's context."""
    if config.num_pages is None:
        return None
    floor_ctx, need = floor_pages(config, mc)
    held = (config.num_pages - 1) * config.page_size
    if held >= floor_ctx:
        return None
    return (f"--num-pages {config.num_pages} holds {held} tokens ({config.num_pages - 1} pages of {config.page_size} "
            f"tokens, the null page apart), less than one --min-context of {floor_ctx} tokens: a request whose prompt "
            f"and max tokens pass {held} tokens is refused; give --num-pages {need} or more, or lower --min-context "
            f"(or --max-model-len) to {held}")


def fixed_setting(config: EngineConfig) -> str | None:
    """The setting that fixes the KV pool (``--num-pages`` first, as the engine reads
    them), in words, or None: the plan sizes it."""
    if config.num_pages is not None:
        return f"--num-pages {config.num_pages}"
    if config.kv_cache is not None:
        return f"--kv-cache {fmt_bytes(config.kv_cache)}"
    return None


def check_host_room(config: EngineConfig, pool_bytes: int, page_bytes: int) -> None:
    """Refuse the KV pool ``config`` fixes (``--kv-cache`` or ``--num-pages``: ``pool_bytes``
    with the null page, ``page_bytes`` a page) when the host's memory cannot hold it:
    more than is available now (Linux's ``MemAvailable``; the physical memory where the
    OS does not say), as a live grow past it is refused. The pool is an anonymous map,
    resident only where written, so it would start; filled, the worker swaps or stalls.

    Raises:
        SettingRefused: naming the memory available and the largest setting it holds.
    """
    total, available = host_memory()
    room = total if available is None else available
    if pool_bytes <= room:
        return
    setting = fixed_setting(config)
    if config.num_pages is not None:
        setting, most = f"{setting} (a KV cache of {fmt_bytes(pool_bytes)})", f"--num-pages {room // page_bytes}"
    else:
        most = f"--kv-cache {room // MiB}MiB"
    raise SettingRefused(
        f"{setting} does not fit the host's memory: {fmt_bytes(room)} is available"
        + ("" if available is None else f" (of {fmt_bytes(total)})")
        + f"; give at most {most}, less what the model's weights take, or leave it unset (on the CPU the "
        f"default pool is {fmt_bytes(DEFAULT_CPU_KV_CACHE_BYTES)}, resident only where written)"
    )
