"""The GPUs of a tensor-parallel worker, watched as one: one source per rank's device.

A worker of ``--tensor-parallel-size N`` holds a shard on each of N GPUs, and its KV
pool has the same pages on every rank, so the group's pool is sized by the tightest GPU
(the one with the least headroom, ``free - reserve``). :class:`GpuGroup` samples every
rank's GPU and hands the watcher one :class:`service.vram.sources.VramSample`: the tightest GPU's, with
``gpus`` holding every GPU's sample in rank order. The replan controller decides on the
tightest one, and its commands go to rank 0, which carries each to every rank alike, in
step (:mod:`engine.core.tp_follow`).

Torch-free, like the rest of the service.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from service.vram.sources import VramSample


def tightest(samples: Sequence[VramSample], reserve_of: Callable[[VramSample], int]) -> VramSample:
    """The sample of least headroom (``free - reserve_of(sample)``) among those that see a
    GPU, the lowest rank on a tie; the first sample when none sees one (CPU mode).

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("a GPU group needs at least one sample")
    seen = [s for s in samples if s.gpu]
    if not seen:
        return samples[0]
    return min(seen, key=lambda s: s.headroom(reserve_of(s)))


class GpuGroup:
    """Samples of every rank's GPU, read as the tightest one.

    Args:
        sources: one ``sample()``-able source per rank, rank 0 first
            (:class:`service.vram.sources.NvmlSource`, ``SimulatedSource``, ``CardOfLimit``).
        reserve_of: the desktop reserve in bytes for a sample (the watcher's setting
            resolved against that card: auto depends on each card's size and display).

    :meth:`sample` returns the tightest GPU's sample (:func:`tightest`) with ``gpus`` set
    to every GPU's sample, in rank order. ``available`` is True while any source is (a
    GPU that cannot be read gives CPU-mode samples and is left out of the choice).
    """

    def __init__(self, sources: Sequence[Any], reserve_of: Callable[[VramSample], int] = lambda s: 0) -> None:
        if not sources:
            raise ValueError("a GPU group needs at least one source")
        self.sources = list(sources)
        self.reserve_of = reserve_of

    @property
    def available(self) -> bool:
        return any(getattr(s, "available", True) for s in self.sources)

    @property
    def reason(self) -> str:
        return next((s.reason for s in self.sources if getattr(s, "reason", "")), "")

    @property
    def simulated(self) -> bool:
        return bool(getattr(self.sources[0], "simulated", False))

    def sample(self) -> VramSample:
        """Every GPU now; the tightest one's sample carries them all in ``gpus``."""
        samples = tuple(s.sample() for s in self.sources)
        return msgspec.structs.replace(tightest(samples, self.reserve_of), gpus=samples)

    def close(self) -> None:
        for s in self.sources:
            close = getattr(s, "close", None)
            if close is not None:
                close()
