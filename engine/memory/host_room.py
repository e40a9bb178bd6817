"""The host memory a KV pool may take: one rule for the start's check of a fixed pool
(:func:`engine.memory.fixed_pool.check_host_room`), a live grow
(``service.vram.host_room.check_host_grow``) and the pool a live change kept when the
next worker loads it (``engine.worker.kept_pool``).

A pool in host memory is an anonymous map, resident only where written, so a pool
larger than the host's memory does not fail at once: filled, the worker swaps or stalls.
So a pool, counted whole, must fit the memory available now (Linux's ``MemAvailable``,
the physical memory where the OS does not say) less a margin
(:func:`host_margin`) that stays free for what is not the pool: a step's activations
and the sampler's buffers, the service, the OS and its page cache. Without the margin
the most a grow offered was all of ``MemAvailable``, leaving a step nothing.

A pool's host bytes (:func:`host_pool_bytes`): the whole pool on the CPU (with a
sliding-window ring pool: :func:`engine.memory.kv_fit.pool_cost`), and on a GPU the
host pool of the decoder layers a split runs on the CPU (``--cpu-layers``: a page of it
priced at the device's bytes a layer of a page); a CUDA device refuses what its memory
cannot hold itself (out of memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.common.units import MiB, fmt_bytes
from engine.memory.host import host_memory
from engine.memory.kv_fit import RingRule, largest, pool_cost

# The least a KV pool leaves free of the host's available memory, in bytes; a larger
# host keeps a sixteenth of its memory (2 GiB of 32 GiB).
HOST_MARGIN_MIN_BYTES = 512 * MiB


def host_margin(total: int) -> int:
    """Bytes of the host's available memory a KV pool leaves free on a host of ``total``
    bytes: :data:`HOST_MARGIN_MIN_BYTES`, or a sixteenth of ``total`` where larger."""
    return max(HOST_MARGIN_MIN_BYTES, total // 16)


@dataclass(frozen=True)
class HostRoom:
    """The host's memory now and what a KV pool may take of it.

    Attributes:
        total: the machine's physical memory, bytes.
        available: Linux's ``MemAvailable``, bytes (None where the OS does not say).
        margin: bytes kept free beside the pool (:func:`host_margin`).
    """

    total: int
    available: int | None
    margin: int

    @property
    def pool_bytes(self) -> int:
        """The most bytes a KV pool (both pools, counted whole) may take now."""
        return max((self.total if self.available is None else self.available) - self.margin, 0)

    def describe(self) -> str:
        """The figures for people: ``"X is available (of T), less M kept free for a
        step's activations and the system"``."""
        have = self.total if self.available is None else self.available
        of = "" if self.available is None else f" (of {fmt_bytes(self.total)})"
        return f"{fmt_bytes(have)} is available{of}, less {fmt_bytes(self.margin)} kept free for a step's " \
               "activations and the system"


def host_room() -> HostRoom:
    """The host's memory now (:func:`engine.memory.host.host_memory`) and its margin.

    Raises:
        OSError: the platform gives no physical page count.
    """
    total, available = host_memory()
    return HostRoom(total=total, available=available, margin=host_margin(total))


class PoolFigures(Protocol):
    """The KV pool's figures :func:`host_pool_bytes` reads (``engine.wire.ipc.PoolStats``
    has them): ``pages`` (null page included), ``page_bytes`` (a page over the
    ``device_layers``), ``cpu_layers`` (a split's layers on the CPU) and ``ring``."""

    pages: int
    page_bytes: int
    device_layers: int
    cpu_layers: int
    ring: RingRule | None


def host_pool_bytes(pool: PoolFigures, pages: int, device: str) -> int:
    """Host bytes a KV pool of ``pages`` pages (the null page included) takes, filled,
    on an engine on ``device`` (``"cpu"``, ``"cuda:0"``, ...): the whole pool on the
    CPU, the host pool of a split's CPU layers on a GPU (0 without one)."""
    split = pages * (pool.page_bytes // max(pool.device_layers, 1) * pool.cpu_layers)
    return split + (0 if device.startswith("cuda") else pool_cost(pages, pool.page_bytes, pool.ring))


def most_host_pages(pool: PoolFigures, pages: int, device: str, room: HostRoom) -> int:
    """The largest pool, at most ``pages`` pages (null page included), whose host bytes
    (:func:`host_pool_bytes`) fit ``room``'s :attr:`HostRoom.pool_bytes`; 0 where none
    does."""
    return largest(0, pages, lambda n: host_pool_bytes(pool, n, device) <= room.pool_bytes)
