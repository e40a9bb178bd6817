"""What the host's memory holds for a live grow of the KV pool: the check the control API
runs before the worker gets a grow (:class:`service.control.actions.SupervisorControl`).

A pool larger than the host's available memory does not fail: the CPU pool is an
anonymous map, resident only where written, so the worker takes it and, once requests
fill it, swaps or stalls until the watchdog kills it. So a grow is refused first, by
the rule the start-up check applies to a fixed ``--kv-cache``
(:func:`engine.memory.fixed_pool.check_host_room`): the new pool, counted whole, must
fit in the memory available now (Linux's ``MemAvailable``, the physical memory where
the OS does not say). That is the grow's peak: the new pool's buffers are made beside
the old ones, whose written pages stay resident (and are already out of the available
memory) until the copy ends. The pool's present size is not added to the available
memory: most of it is not resident, so it frees little.

The host holds the whole pool on the CPU (with a sliding-window ring pool:
:func:`engine.memory.kv_fit.pool_cost`), and on a GPU the host pool of the decoder
layers a split runs on the CPU (``--cpu-layers``: a page of it priced at the device's
bytes a layer of a page); a CUDA device refuses a grow its memory cannot hold itself
(out of memory), so its part is the card's check (:mod:`service.vram.room`).

Torch-free: the figures are the worker's ``engine.wire.ipc.PoolStats``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.memory.host import host_memory
from engine.memory.kv_fit import largest, pool_cost, usable_pages
from engine.memory.plan import fmt_bytes
from service.common.errors import APIError
from service.vram.room import NO_ROOM

if TYPE_CHECKING:
    from engine.wire.ipc import PoolStats


def host_pool_bytes(pool: PoolStats, pages: int, device: str) -> int:
    """Host bytes a KV pool of ``pages`` pages (the null page included) takes, filled,
    on an engine on ``device`` (``"cpu"``, ``"cuda:0"``, ...): the whole pool on the
    CPU, the host pool of a split's CPU layers on a GPU (0 without one)."""
    split = pages * (pool.page_bytes // max(pool.device_layers, 1) * pool.cpu_layers)
    return split + (0 if device.startswith("cuda") else pool_cost(pages, pool.page_bytes, pool.ring))


def check_host_grow(pool: PoolStats, pages: int, device: str) -> None:
    """Refuse a grow of the KV pool to ``pages`` pages (null page included) whose new
    pool (:func:`host_pool_bytes`) does not fit in the host's available memory now;
    nothing for a shrink, or where the host holds none of the pool.

    Raises:
        APIError: 409 ``no_room`` (``param: "kv_cache"``), naming the memory available
            and the largest KV cache that fits (or that no page more does).
    """
    need = host_pool_bytes(pool, pages, device)
    if pages <= pool.pages or need <= 0:
        return
    total, available = host_memory()
    room = total if available is None else available
    if need <= room:
        return
    lo = largest(0, pages, lambda n: host_pool_bytes(pool, n, device) <= room)  # the largest pool that fits
    most = usable_pages(lo)
    fits = (f"the most it can grow to now is {fmt_bytes(pool_cost(lo, pool.page_bytes, pool.ring) - pool.page_bytes)} "
            f"({most} pages)" if lo > pool.pages else f"no page more fits now: it stays at {usable_pages(pool.pages)} pages")
    split = (f" (with the host pool of {pool.cpu_layers} layers on the CPU, "
             f"{fmt_bytes(need // pages)} a page)" if pool.cpu_layers else "")
    raise APIError(
        409,
        f"a KV cache of {usable_pages(pages)} pages takes {fmt_bytes(need)} of host memory{split}: the new pool is "
        "counted whole, as at start, since the old one's written pages stay beside it until the copy "
        f"ends; {fmt_bytes(room)} is available"
        + ("" if available is None else f" (of {fmt_bytes(total)})") + f"; {fits}",
        code=NO_ROOM,
        param="kv_cache",
    )
