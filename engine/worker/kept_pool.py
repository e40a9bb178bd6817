"""The KV pool a live change kept, taken up by the next worker once its engine loaded.

A live ``{"kv_cache": SIZE}`` is kept for every next worker (a resume, a restart, one
after a crash): the service sends it as ``WorkerConfig.kv_pages``, beside the start's
sizing (``--kv-cache``, ``--num-pages`` or the plan), which the engine loads with, so
the worker still knows its start pool: the pool a live ``{"kv_cache": null}`` goes back
to. Once loaded the worker resizes its pool to the kept size, after the check a live
grow meets (:mod:`engine.memory.host_room`: the new pool counted whole against the
host's available memory now, less the margin kept free). The host's memory may have
changed since the size was set; a kept size that no longer fits is cut to the most
that fits (never below the start's pool, which the engine's own start check passed),
and a warning says so. A kept shrink is always taken.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.memory.host_room import host_pool_bytes, host_room, most_host_pages
from engine.memory.kv_fit import usable_pages
from engine.memory.plan import fmt_bytes
from engine.wire.ipc import PoolStats
from engine.wire.messages import BY_CONTROL

log = logging.getLogger("headroom.worker")

# The reason a kept size's resize gives (its log line and its replan event).
KEPT_REASON = "the KV cache size set live through the control API, kept for this worker"


def take_kept_pool(engine: Any, kv_pages: int | None, pool: PoolStats | None) -> int | None:
    """Resize ``engine``'s KV pool, as loaded with the start's sizing, to the kept
    ``kv_pages`` (pages, the null page included), or to the most of it the host's memory
    holds now (:func:`engine.memory.host_room.most_host_pages`; at least the start's
    pool). ``pool``: the engine's figures now (``engine.worker.process.pool_stats``),
    None for an engine that cannot resize its pool.

    Returns:
        The pages the pool holds after it (null page included), or None where nothing
        was kept or the engine cannot resize its pool (a warning then says the start's
        pool is used). A grow the device cannot hold (out of memory) leaves the start's
        pool, with a warning.
    """
    if kv_pages is None:
        return None
    if pool is None:
        log.warning("the KV cache size set live (%d pages) is not taken: this engine cannot resize its pool; it "
                    "keeps the start's", usable_pages(kv_pages))
        return None
    device = str(engine.device)
    pages, room = kv_pages, host_room()
    if kv_pages > pool.pages and host_pool_bytes(pool, kv_pages, device) > room.pool_bytes:
        pages = max(most_host_pages(pool, kv_pages, device, room), pool.pages)
        log.warning("the KV cache size set live, %d pages (%s of host memory), no longer fits the host's memory: "
                    "%s; this worker starts with %d pages (%s)%s", usable_pages(kv_pages),
                    fmt_bytes(host_pool_bytes(pool, kv_pages, device)), room.describe(), usable_pages(pages),
                    fmt_bytes(usable_pages(pages) * pool.page_bytes),
                    ", the start's size" if pages == pool.pages else ", the most that fits now")
    if pages == pool.pages:
        return pages
    why = KEPT_REASON if pages == kv_pages else f"{KEPT_REASON}, cut to what the host's memory holds now"
    try:
        engine.resize_kv_pool(pages, reason=why, origin=BY_CONTROL)
    except Exception as exc:
        if type(exc).__name__ != "OutOfMemoryError":
            raise
        log.warning("the KV cache size set live (%d pages) did not fit the device: this worker keeps the start's "
                    "%d pages (%s)", usable_pages(pages), usable_pages(pool.pages), str(exc).partition("\n")[0])
    return engine.pool.num_pages
