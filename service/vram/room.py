"""What a person may take of the card now: the room the control API checks a grow of the
KV pool, or a move of decoder layers back to the device, against before the worker
gets it (:class:`service.control.actions.SupervisorControl`).

The room is the headroom of the VRAM watcher's last sample (``free - reserve``,
:meth:`service.vram.sources.VramSample.headroom`), less the grows carried out that the
sample cannot show yet (:meth:`service.vram.watcher.VramWatcher.expected`: a second grow
before the next sample does not take the first one's memory again), less the floor the watcher's own
grows keep (:attr:`service.vram.replan.ReplanController.grow_floor_bytes`, a quarter of
the replan band above low water): a person's grow may go as far as the watcher would
grow by itself, and no further, so the watcher does not give it back at its next
sample (and a real card does not fail it with out-of-memory). Shrinks, and moves of
layers to the CPU, take nothing and are never checked.

A size asked for that does not fit is refused (409, code ``no_room``) naming the
shortfall and the largest value that fits now; it is not cut to that value, so what
happens is what was asked for or nothing. Back to the plan's pool (a null size) is not
a size asked for: it grows as far toward the plan's ceiling as fits now
(:func:`fitting_pages`), as the watcher's own grows do, and the watcher grows the rest
when memory returns.

Torch-free: the figures are the sample's and the worker's ``engine.wire.ipc.PoolStats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.memory.kv_fit import pages_within, pool_cost, usable_pages
from engine.memory.plan import fmt_bytes
from service.common.errors import APIError
from service.vram.replan import default_water_marks
from service.vram.split_rung import layer_share

if TYPE_CHECKING:
    from engine.wire.ipc import PoolStats
    from service.vram.watcher import VramWatcher

NO_ROOM = "no_room"  # the error code of a grow the card cannot hold now


@dataclass(frozen=True)
class Room:
    """The card's room for a person's grow, in bytes: ``room_bytes`` (may be negative)
    is ``headroom_bytes - floor_bytes``; ``free_bytes`` and ``reserve_bytes`` are the
    sample's free memory and the reserve the headroom subtracts."""

    room_bytes: int
    headroom_bytes: int
    floor_bytes: int
    free_bytes: int
    reserve_bytes: int

    def words(self) -> str:
        """The figures for an error message."""
        return (f"the card's headroom now is {fmt_bytes(self.headroom_bytes)} (free "
                f"{fmt_bytes(self.free_bytes)} - reserve {fmt_bytes(self.reserve_bytes)}), of which the "
                f"watcher keeps {fmt_bytes(self.floor_bytes)} spare")


def card_room(watcher: VramWatcher | None) -> Room | None:
    """The room on the watched card now, or None where nothing is known or nothing is at
    stake: no watcher or no sample yet, CPU mode (no GPU), or an engine on the CPU
    beside a real GPU (its memory is the host's, not the card's)."""
    if watcher is None or watcher.latest is None or not watcher.latest.gpu:
        return None
    info = watcher.supervisor.info
    if watcher.kind != "simulated" and (info is None or not info.device.startswith("cuda")):
        return None
    sample = watcher.expected()
    assert sample is not None
    reserve = watcher.reserve_bytes(sample)
    if watcher.controller is not None:
        floor = watcher.controller.grow_floor_bytes
    else:
        low, high = default_water_marks(sample.total_bytes)
        floor = low + (high - low) // 4
    headroom = sample.headroom(reserve)
    return Room(headroom - floor, headroom, floor, sample.free_bytes, reserve)


def fitting_pages(room: Room | None, pool: PoolStats, pages: int) -> int:
    """``pages`` (a KV pool, null page included), or where growing to it does not fit
    ``room``, the largest pool between the pool now and it that does (the pool now when
    not one page more fits; a sliding-window ring pool grows beside it:
    :func:`engine.memory.kv_fit.pool_cost`)."""
    if room is None or pages <= pool.pages:
        return pages
    return pages_within(pool.pages, pool.page_bytes, pool.ring, max(room.room_bytes, 0), pages)


def check_pool_grow(room: Room | None, pool: PoolStats, pages: int) -> None:
    """Refuse a KV pool of ``pages`` pages (null page included) that grows the device's
    part of the pool past ``room``.

    Raises:
        APIError: 409 ``no_room``, naming the shortfall and the largest pool that fits.
    """
    if room is None or pages <= pool.pages:
        return
    grow = pool_cost(pages, pool.page_bytes, pool.ring) - pool_cost(pool.pages, pool.page_bytes, pool.ring)
    if grow <= room.room_bytes:
        return
    most = usable_pages(pages_within(pool.pages, pool.page_bytes, pool.ring, max(room.room_bytes, 0), pages))
    fits = (f"the most that fits now is {fmt_bytes(most * pool.page_bytes)} ({most} pages)"
            if most >= pool.pages else f"no page more fits now: it stays at {usable_pages(pool.pages)} pages")
    raise APIError(
        409,
        f"a KV cache of {usable_pages(pages)} pages ({fmt_bytes(usable_pages(pages) * pool.page_bytes)}) takes "
        f"{fmt_bytes(grow)} more of the card; {room.words()}: short by {fmt_bytes(grow - room.room_bytes)}; "
        f"{fits}",
        code=NO_ROOM,
        param="kv_cache",
    )


def check_split_move(room: Room | None, pool: PoolStats, cpu_layers: int) -> None:
    """Refuse a move of layers back to the device (``cpu_layers`` below the count now)
    whose weights and share of the pool (:func:`service.vram.split_rung.layer_share`)
    do not fit in ``room``.

    Raises:
        APIError: 409 ``no_room``, naming the shortfall and the fewest layers on the CPU
            that fit.
    """
    back = pool.cpu_layers - cpu_layers
    share = layer_share(pool, pool.pages)
    if room is None or back <= 0 or share <= 0:
        return
    need = back * share
    if need <= room.room_bytes:
        return
    fewest = pool.cpu_layers - max(room.room_bytes, 0) // share
    fits = (f"the fewest that fit now is cpu_layers {fewest}" if fewest < pool.cpu_layers
            else f"not one layer fits now: it stays at {pool.cpu_layers}")
    raise APIError(
        409,
        f"moving {back} decoder layers back to the device (cpu_layers {pool.cpu_layers} -> {cpu_layers}) takes "
        f"{fmt_bytes(need)} of the card ({fmt_bytes(share)} a layer: its weights and its keys and values); "
        f"{room.words()}: short by {fmt_bytes(need - room.room_bytes)}; {fits}",
        code=NO_ROOM,
        param="cpu_layers",
    )
