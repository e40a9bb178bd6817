"""What the host's memory holds for a live grow of the KV pool: the check the control API
runs before the worker gets a grow (:class:`service.control.actions.SupervisorControl`).

A grow is refused by the rule the start-up check applies to a fixed ``--kv-cache``
(:mod:`engine.memory.host_room`): the new pool, counted whole, must fit in the memory
available now less the margin kept free for a step's activations and the system. That
is the grow's peak: the new pool's buffers are made beside the old ones, whose written
pages stay resident (and are already out of the available memory) until the copy ends.
The pool's present size is not added to the available memory: most of it is not
resident, so it frees little. A CUDA device refuses a grow its memory cannot hold
itself (out of memory), so its part is the card's check (:mod:`service.vram.room`).

Torch-free: the figures are the worker's ``engine.wire.ipc.PoolStats``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.memory.host_room import host_pool_bytes, host_room, most_host_pages
from engine.memory.kv_fit import pool_cost, usable_pages
from engine.memory.plan import fmt_bytes
from service.common.errors import APIError
from service.vram.room import NO_ROOM

if TYPE_CHECKING:
    from engine.wire.ipc import PoolStats


def check_host_grow(pool: PoolStats, pages: int, device: str) -> None:
    """Refuse a grow of the KV pool to ``pages`` pages (null page included) whose new
    pool (:func:`engine.memory.host_room.host_pool_bytes`) does not fit the host's
    available memory now less its margin (:func:`engine.memory.host_room.host_room`);
    nothing for a shrink, or where the host holds none of the pool.

    Raises:
        APIError: 409 ``no_room`` (``param: "kv_cache"``), naming the memory available
            and the largest KV cache that fits (or that no page more does).
    """
    need = host_pool_bytes(pool, pages, device)
    if pages <= pool.pages or need <= 0:
        return
    room = host_room()
    if need <= room.pool_bytes:
        return
    lo = most_host_pages(pool, pages, device, room)
    most = usable_pages(lo)
    fits = (f"the most it can grow to now is {fmt_bytes(pool_cost(lo, pool.page_bytes, pool.ring) - pool.page_bytes)} "
            f"({most} pages)" if lo > pool.pages else f"no page more fits now: it stays at {usable_pages(pool.pages)} pages")
    split = (f" (with the host pool of {pool.cpu_layers} layers on the CPU, "
             f"{fmt_bytes(need // pages)} a page)" if pool.cpu_layers else "")
    raise APIError(
        409,
        f"a KV cache of {usable_pages(pages)} pages takes {fmt_bytes(need)} of host memory{split}: the new pool is "
        "counted whole, as at start, since the old one's written pages stay beside it until the copy "
        f"ends; {room.describe()}; {fits}",
        code=NO_ROOM,
        param="kv_cache",
    )
