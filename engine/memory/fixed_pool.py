"""The KV pool's size where no memory plan is fitted: a CPU run without a simulated
device, or a fixed ``--kv-cache`` or ``--num-pages``. The engine sizes its pool with it,
and ``headroom plan`` shows the same figure. For a model whose sliding-window layers
keep a ring (:mod:`engine.kvcache.ring`) a size holds both pools, the KV pool's pages and
the ring pool beside them, split as the plan splits a card's room
(:mod:`engine.memory.kv_fit`), so the two together never pass it (their null pages
apart), and the control API's live size means the same
(:func:`engine.memory.kv_fit.pages_in_bytes`). A fixed pool that holds less than one
``--min-context`` is refused (``--kv-cache``) or warned about (``--num-pages``, which
small test pools use), and one whose two pools pass the host's available memory is
refused where the host holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import SettingRefused
from engine.common.units import MiB, fmt_bytes, fmt_bytes_down
from engine.memory.host_room import host_room
from engine.memory.kv_fit import RingPrice, kv_pages, room_for, split_room, usable_pages

# The CPU pool's default size: an anonymous map, resident only where written
# (engine.kvcache.pool), so an idle or short-context run costs little of it.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class FixedPoolSize:
    """The KV pool and the sliding-window ring pool beside it where no plan is fitted.

    Attributes:
        pages: KV pool pages, the null page included.
        rings: ring pool pages, the null page apart (0 without a ring).
        wanted_pages: KV pages of one request of the wanted context, where the rings
            follow the plan's rule (:class:`engine.memory.kv_fit.RingRule`); 0 for
            ``--num-pages``, whose rings are their bound capped by the pages.
    """

    pages: int
    rings: int
    wanted_pages: int

    def nbytes(self, page_bytes: int, ring: RingPrice | None) -> int:
        """Both pools' buffers, null pages included, in bytes."""
        return self.pages * page_bytes + ((self.rings + 1) * ring.page_bytes if ring is not None else 0)


def unplanned_pool(config: EngineConfig, mc: ModelConfig, page_bytes: int, ring: RingPrice | None = None
                   ) -> FixedPoolSize:
    """The KV pool and ring pool the engine holds without a plan: ``--num-pages`` pages
    (the rings' bound beside them, at most as many); else ``--kv-cache`` bytes, or
    :data:`DEFAULT_CPU_KV_CACHE_BYTES`, holding the usable pages of both pools (null
    pages apart), split as the plan splits a card's room
    (:func:`engine.memory.kv_fit.split_room`); without ``--kv-cache``, never less than
    one full context of the model (capped by ``--max-model-len``) beside the rings'
    floor. ``page_bytes``: one KV pool page's keys and values, in bytes (over the layers
    that do not keep a ring); ``ring``: the ring pool's price, None without a ring.

    Raises:
        SettingRefused: ``--kv-cache`` holds less than one ``--min-context`` (capped by
            the model's context and ``--max-model-len``), its ring counted: a server that
            could answer only a few tokens is refused, with the size that fits.
    """
    if config.num_pages is not None:
        rings = min(ring.full_cap, max(config.num_pages - 1, 1)) if ring is not None else 0
        return FixedPoolSize(config.num_pages, rings, 0)
    wanted = math.ceil(_wanted_context(config, mc) / config.page_size)
    if config.kv_cache is None:
        pages, rings = split_room(max(DEFAULT_CPU_KV_CACHE_BYTES, room_for(wanted, page_bytes, ring)), page_bytes,
                                  ring, wanted)
        return FixedPoolSize(pages + 1, rings, wanted)
    pages, rings = split_room(config.kv_cache, page_bytes, ring, wanted)
    floor_ctx, need = floor_pages(config, mc)
    if pages < need - 1:
        besides = "" if ring is None else (f" and a ring page of {fmt_bytes(ring.page_bytes)} for the sliding-window "
                                           "layers")
        raise SettingRefused(
            f"--kv-cache {fmt_bytes_down(config.kv_cache)} holds {pages * config.page_size} tokens of this model "
            f"({fmt_bytes(page_bytes)} a page of {config.page_size} tokens{besides}), less than one --min-context of "
            f"{floor_ctx} tokens: give at least --kv-cache "
            f"{math.ceil(room_for(need - 1, page_bytes, ring) / MiB)}MiB, or a smaller --min-context"
        )
    return FixedPoolSize(pages + 1, rings, wanted)


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
    held = usable_pages(config.num_pages) * config.page_size
    if held >= floor_ctx:
        return None
    return (f"--num-pages {config.num_pages} holds {held} tokens ({usable_pages(config.num_pages)} pages of {config.page_size} "
            f"tokens, the null page apart), less than one --min-context of {floor_ctx} tokens: a request whose prompt "
            f"and max tokens pass {held} tokens is refused; give --num-pages {need} or more, or lower --min-context "
            f"(or --max-model-len) to {held}")


def fixed_setting(config: EngineConfig) -> str | None:
    """The setting that fixes the KV pool (``--num-pages`` first, as the engine reads
    them), in words, or None: the plan sizes it."""
    if config.num_pages is not None:
        return f"--num-pages {config.num_pages}"
    if config.kv_cache is not None:
        return f"--kv-cache {fmt_bytes_down(config.kv_cache)}"
    return None


def check_host_room(config: EngineConfig, pool: FixedPoolSize, page_bytes: int, ring: RingPrice | None) -> None:
    """Refuse the KV pool ``config`` fixes (``--kv-cache`` or ``--num-pages``: ``pool``,
    of pages of ``page_bytes`` and the ring pool ``ring`` prices beside them) when the
    host's memory cannot hold both pools' buffers (:meth:`FixedPoolSize.nbytes`): more
    than is available now less the margin kept free for a step's activations and the
    system (:func:`engine.memory.host_room.host_room`), the rule a live grow and a kept
    live size meet too. The pools are anonymous maps, resident only where written, so
    they would start; filled, the worker swaps or stalls.

    Raises:
        SettingRefused: naming the memory available and the largest setting it holds.
    """
    room = host_room()
    pool_bytes = pool.nbytes(page_bytes, ring)
    if pool_bytes <= room.pool_bytes:
        return
    setting = fixed_setting(config)
    # What the room holds beside the null pages: the usable pages of both pools.
    usable = room.pool_bytes - page_bytes - (ring.page_bytes if ring is not None else 0)
    if config.num_pages is not None:
        held = kv_pages(usable, page_bytes, *((ring.page_bytes, ring.full_cap) if ring is not None else ()))
        setting, most = f"{setting} (a KV cache of {fmt_bytes(pool_bytes)})", f"--num-pages {held + 1}"
    else:
        most = f"--kv-cache {max(usable, 0) // MiB}MiB"
    raise SettingRefused(
        f"{setting} does not fit the host's memory: {room.describe()}; give at most {most}, less what the "
        "model's weights take, or leave it unset (on the CPU the "
        f"default pool is {fmt_bytes(DEFAULT_CPU_KV_CACHE_BYTES)}, resident only where written)"
    )
