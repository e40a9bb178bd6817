"""The replan ladder's last rung: a dense model's split (``--cpu-layers auto``) moved
between the device and the CPU (``Engine.move_split``), for
:class:`service.vram.replan.ReplanController`.

Giving back: only once the KV pool is at its floor (one request of the minimum context)
and the device is still short, the fewest of the device's last decoder layers whose
weights and keys and values free what is missing go to the CPU (one layer always stays
on the device). A layer frees its weights (``layer_bytes``, the plan's price of the
largest layer) and its share of the pool at its floor (``page_bytes / device_layers``
a page). Decode gets slower with every layer moved; requests keep running. The layers
free what the headroom shows missing, never the doubled probe a pinned card gets (its
memory is wanted by an unknown demand; the pool's pages answer that): a card that stays
pinned moves more layers at its next decisions instead.

Taking back: the layers the CPU runs beyond the start's split come back first, before
the pool grows, as many as fit in the spare headroom (each costs its weights and its
share of the pool as it is now); the pool grows only once the split is back.

Torch-free, like the controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class PoolState(Protocol):
    """The figures of :class:`service.vram.replan.PoolState` this rung reads (the KV
    pool's pages now and at its floor, one page's device bytes, and the split's)."""

    pages: int
    min_pages: int
    page_bytes: int
    cpu_layers: int
    planned_cpu_layers: int
    max_cpu_layers: int
    layer_bytes: int
    device_layers: int


@dataclass(frozen=True)
class NewSplit:
    """Run the last ``cpu_layers`` decoder layers on the CPU (``Engine.move_split``);
    ``before`` is the count now."""

    cpu_layers: int
    before: int
    reason: str

    @property
    def grows(self) -> bool:
        """Whether the device's part grows (layers come back)."""
        return self.cpu_layers < self.before


def layer_share(pool: PoolState, pages: int) -> int:
    """Device bytes one decoder layer takes with a pool of ``pages`` pages: its weights
    and its keys and values (0 where the split cannot move)."""
    if pool.max_cpu_layers <= 0 or pool.device_layers <= 0:
        return 0
    return pool.layer_bytes + pages * pool.page_bytes // pool.device_layers


def give_back(pool: PoolState, short: int, pages: int, reason: str) -> tuple[NewSplit | None, int]:
    """The move that frees ``short`` bytes once the pool is at ``pages`` (its floor),
    and the bytes it frees: the fewest layers that do, capped by what the CPU may run
    (all it may, when even that is not enough); ``(None, 0)`` where no layer can move."""
    share = layer_share(pool, pages)
    room = pool.max_cpu_layers - pool.cpu_layers
    if short <= 0 or share <= 0 or room <= 0 or pages > max(pool.min_pages, 2):
        return None, 0
    k = min(math.ceil(short / share), room)
    return NewSplit(pool.cpu_layers + k, pool.cpu_layers, reason), k * share


def take_back(pool: PoolState, spare: int, reason: str) -> tuple[NewSplit | None, int]:
    """The layers beyond the start's split that fit in ``spare`` bytes, moved back, and
    what they take; ``(None, 0)`` when none fits or none is beyond the start's split."""
    extra = pool.cpu_layers - pool.planned_cpu_layers
    share = layer_share(pool, pool.pages)
    if extra <= 0 or share <= 0:
        return None, 0
    k = min(extra, max(spare, 0) // share)
    if k <= 0:
        return None, 0
    return NewSplit(pool.cpu_layers - k, pool.cpu_layers, reason), k * share
