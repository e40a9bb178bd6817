"""Grows of the engine's device memory that a VRAM sample may not show yet.

The watcher decides on one sample (:class:`service.vram.sources.VramSample`) at a time,
and the control API checks a person's grow against the latest one
(:mod:`service.vram.room`). A grow carried out after a sample's read began is not in
that sample: judged against it, a second grow would take the same free memory again
(two grows of 800 MiB each fitting a room of 1 GiB). :class:`UnseenGrows` counts every
grow carried out (the watcher's and the control API's) with an epoch, notes the epoch
at which each sample's read began, and gives the sample as it is expected to be: its
free memory less the grows it cannot show, which are this service's memory. Once a
sample whose read began after a grow is seen, that grow is forgotten: every later
sample shows it.

A read that began before a grow was answered but ran while the worker allocated may
show it already; it is then counted twice for that one sample (a grow judged too
tight, never too loose).

Torch-free: the figures are the actions' and the worker's ``engine.wire.ipc.PoolStats``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from engine.memory.kv_fit import pool_cost
from service.vram.replan import NewChunkCap, NewExpertCache, NewPoolSize
from service.vram.split_rung import NewSplit, layer_share

if TYPE_CHECKING:
    from engine.wire.ipc import PoolStats
    from service.vram.sources import VramSample


def grown_bytes(action: Any, pool: PoolStats) -> int:
    """Device bytes ``action`` takes on the worker's ``pool`` (as it was before it); 0
    for what gives memory back or takes none (a prefix-cache eviction)."""
    if isinstance(action, NewPoolSize):  # a sliding-window ring pool grows beside it
        return max(pool_cost(action.num_pages, pool.page_bytes, pool.ring)
                   - pool_cost(action.before, pool.page_bytes, pool.ring), 0)
    if isinstance(action, NewExpertCache):
        return max(action.num_slots - action.before, 0) * pool.expert_slot_bytes
    if isinstance(action, NewChunkCap):
        return max(action.tokens - action.before, 0) * pool.activation_bytes_per_token
    if isinstance(action, NewSplit):
        return max(action.before - action.cpu_layers, 0) * layer_share(pool, pool.pages)  # type: ignore[arg-type]
    return 0


class UnseenGrows:
    """The grows carried out, by epoch (1, 2, ...), until a sample shows them.

    Attributes:
        epoch: the epoch of the last grow (0 before any); a read that begins now shows
            every grow up to it.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self._grows: list[tuple[int, int]] = []  # (epoch, bytes)
        self._sample: VramSample | None = None
        self._read_epoch = 0

    def add(self, nbytes: int) -> None:
        """A grow of ``nbytes`` bytes was carried out (nothing for ``nbytes <= 0``)."""
        if nbytes > 0:
            self.epoch += 1
            self._grows.append((self.epoch, nbytes))

    def note(self, sample: VramSample, read_epoch: int | None = None) -> None:
        """``sample`` is the latest; its read began at ``read_epoch`` (None: after every
        grow so far). The grows it shows are forgotten. Noting the same sample again
        changes nothing."""
        if sample is self._sample:
            return
        self._sample = sample
        self._read_epoch = self.epoch if read_epoch is None else read_epoch
        self._grows = [(e, b) for e, b in self._grows if e > self._read_epoch]

    def unseen_bytes(self, sample: VramSample) -> int:
        """Bytes grown that ``sample`` cannot show (it is noted first)."""
        self.note(sample)
        return sum(b for e, b in self._grows if e > self._read_epoch)

    def expected(self, sample: VramSample) -> VramSample:
        """``sample`` with the grows it cannot show taken from its free memory and
        counted as this service's: what the next sample should read (its free memory
        below zero where they take more than was free, as a ``--device-limit`` card's
        reads when more is in use than the limit)."""
        unseen = self.unseen_bytes(sample)
        if unseen <= 0 or not sample.gpu:
            return sample
        return msgspec.structs.replace(sample, free_bytes=sample.free_bytes - unseen,
                                       ours_bytes=sample.ours_bytes + unseen)
