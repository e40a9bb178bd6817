"""The VRAM watcher's eyes: what the GPU's memory looks like now, and the desktop reserve.

A desktop GPU's free memory moves all the time (a game starts, a browser tab decodes a
video), so the service samples it a few times a second and replans when the headroom (``free - reserve``) runs low. This module provides the
samples; :mod:`service.vram.replan` decides what to do with them.

Two sources give the same :class:`VramSample`:

- :class:`NvmlSource` reads NVML through ``pynvml`` (the ``nvidia-ml-py`` package): the
  card's total and free memory, what NVML attributes to this service's processes (by
  pid: the service and its worker) and to everyone else, the largest other consumers,
  and whether a display is attached. Where NVML, the driver or the GPU is missing, it
  is in a clear *CPU mode* (``sample().gpu`` is False, ``reason`` says why): it never
  raises, neither at start nor when the GPU goes away later.
- :class:`service.vram.simulated.SimulatedSource` plays a scripted timeline of other
  processes' memory (a list of ``(t_seconds, others_bytes)`` steps or a function of
  time), for tests and for ``--device-total`` style simulations.

Torch-free, like the rest of the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec

from engine.memory.device import nvml_index as nvml_index  # also the engine's mapping
from engine.memory.device import proc_name
from engine.memory.plan import reserve_for

log = logging.getLogger("headroom.vram")

# Samples per second of the watcher: a few times a second. NVML answers a
# memory query in well under a millisecond, so 4 Hz costs nothing and sees a game's
# allocation within 250 ms.
DEFAULT_SAMPLE_HZ = 4.0
# How many other processes a sample names.
TOP_CONSUMERS = 5


class GpuProcess(msgspec.Struct, frozen=True):
    """A process NVML lists on the GPU: ``pid``, its name (``/proc/<pid>/comm``, ``"?"``
    when unknown) and the device memory NVML attributes to it."""

    pid: int
    name: str
    bytes: int


class VramSample(msgspec.Struct, frozen=True, kw_only=True):
    """The GPU's memory at one instant, in bytes.

    ``gpu`` is False in CPU mode (no NVML, no driver, no GPU): then every size is 0 and
    ``reason`` says why. ``timestamp`` is the source's clock (``time.monotonic`` for
    NVML, the scripted time for a simulation), in seconds.

    ``ours_bytes`` is what NVML attributes to this service's pids, ``others_bytes`` the
    rest of the used memory (other apps, the desktop, a dying predecessor, and memory
    NVML attributes to no visible process). ``processes`` lists every process NVML
    names, largest first; ``top_consumers`` the largest ones that are not ours.
    ``pids_visible`` is False where NVML lists no process at all although memory is in
    use (a container without the host's pid namespace, some Windows drivers): then
    nothing can be attributed by pid and ``ours_bytes`` reads 0.

    ``device_limit_bytes`` is set when the sample is read as a smaller card
    (``--device-limit``, :func:`as_card`): then ``total_bytes`` is that card's size and
    ``free_bytes`` what is free on it.

    ``gpus`` is set on the sample of a tensor-parallel worker's GPUs
    (:class:`service.vram.gpus.GpuGroup`): every rank's GPU, in rank order, while the
    other fields are the tightest GPU's (the least headroom). Empty for one GPU.
    """

    timestamp: float
    gpu: bool
    device: str = ""
    total_bytes: int = 0
    free_bytes: int = 0
    ours_bytes: int = 0
    others_bytes: int = 0
    display_attached: bool = False
    top_consumers: tuple[GpuProcess, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    pids_visible: bool = True
    reason: str = ""
    device_limit_bytes: int | None = None
    gpus: tuple[VramSample, ...] = ()

    def headroom(self, reserve_bytes: int) -> int:
        """``free - reserve``: what can still be taken before the desktop suffers."""
        return self.free_bytes - reserve_bytes

    def held_by(self, pid: int) -> int | None:
        """Bytes NVML attributes to ``pid``, None when NVML does not list it; with
        ``gpus``, summed over every GPU that lists it."""
        if self.gpus:
            held = [b for b in (g.held_by(pid) for g in self.gpus) if b is not None]
            return sum(held) if held else None
        for p in self.processes:
            if p.pid == pid:
                return p.bytes
        return None


def as_card(sample: VramSample, limit_bytes: int | None) -> VramSample:
    """``sample`` as read on a card of ``limit_bytes`` (``--device-limit``), the rule the
    memory plan applies at start (:func:`engine.memory.ledger.make_plan`): the card's total
    is the limit, and everything in use (other processes' memory and ours) counts
    against it, as on a real card of that size.

    ``free_bytes`` is the limit less what is in use on the real card (its free memory
    less the part of the card beyond the limit). It reads below zero when the other
    processes and this service together hold more than the limit (the real, larger card
    let them): the headroom then says by how much, and the replan controller gives back
    exactly that.

    A sample without a GPU, without a limit, or of a card no larger than the limit is
    returned as is (a limit above the card changes nothing, as in the plan).
    """
    if limit_bytes is None or not sample.gpu or sample.total_bytes <= limit_bytes:
        return sample
    in_use = sample.total_bytes - sample.free_bytes
    return msgspec.structs.replace(
        sample, total_bytes=limit_bytes, free_bytes=limit_bytes - in_use, device_limit_bytes=limit_bytes
    )


class CardOfLimit:
    """A VRAM source read as a card of ``limit_bytes`` (:func:`as_card`): the watcher and
    the replan controller see the card the plan was made for. Everything else (``name``,
    ``available``...) is the wrapped source's."""

    def __init__(self, source: Any, limit_bytes: int) -> None:
        self.source = source
        self.limit_bytes = limit_bytes

    def sample(self, *args: Any, **kwargs: Any) -> VramSample:
        return as_card(self.source.sample(*args, **kwargs), self.limit_bytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def cpu_mode_sample(reason: str, timestamp: float | None = None) -> VramSample:
    """A sample that says "no GPU, CPU mode" and why."""
    return VramSample(
        timestamp=time.monotonic() if timestamp is None else timestamp, gpu=False, reason=reason
    )


def resolve_reserve(setting: int | str | None, sample: VramSample) -> int:
    """The desktop reserve in bytes for ``--reserve``: a size (bytes, as
    ``service.common.settings`` parses it), or ``None`` / ``"auto"``.

    Auto is :func:`engine.memory.plan.reserve_for` (documented there): 512 MiB plus 5% of
    the card when a display is attached to the GPU (a compositor with two 4K surfaces
    and a browser's GPU process commonly hold 300-600 MiB, and larger cards drive larger
    desktops), 0 on a headless card. In CPU mode there is nothing to reserve: 0.

    Raises:
        ValueError: a negative size or text other than ``"auto"``.
    """
    if setting is None or (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return reserve_for(sample.total_bytes, sample.display_attached) if sample.gpu else 0
    if isinstance(setting, str) or isinstance(setting, bool) or setting < 0:
        raise ValueError(f"--reserve must be 'auto' or a size of at least 0 bytes, got {setting!r}")
    return int(setting)


def _pid_set(own_pids: Callable[[], Iterable[int]] | Iterable[int]) -> frozenset[int]:
    return frozenset(own_pids() if callable(own_pids) else own_pids)


def split_by_owner(
    procs: dict[int, int], own: frozenset[int], used: int, names: Callable[[int], str]
) -> tuple[int, int, tuple[GpuProcess, ...], tuple[GpuProcess, ...]]:
    """(ours, others, all processes, top other consumers) from NVML's pid -> bytes."""
    listed = tuple(
        sorted((GpuProcess(pid, names(pid), b) for pid, b in procs.items()), key=lambda p: -p.bytes)
    )
    ours = sum(p.bytes for p in listed if p.pid in own)
    top = tuple(p for p in listed if p.pid not in own)[:TOP_CONSUMERS]
    return ours, max(used - ours, 0), listed, top


# Seconds between attempts to open NVML again after it failed (a sample at 4 Hz would
# otherwise call nvmlInit four times a second on a machine without a driver).
REOPEN_INTERVAL_S = 10.0


class NvmlSource:
    """Samples one GPU through NVML; a CPU-mode source where that is impossible.

    Args:
        index: NVML's device index (see :func:`nvml_index`).
        own_pids: this service's pids (the service and its current worker), or a
            function that returns them at each sample (the worker's pid changes when it
            restarts). Default: this process.
        nvml: the ``pynvml`` module to use (tests pass a fake); default: import it.
        clock: seconds for ``timestamp``.

    NVML is initialized here and shut down by :meth:`close`. Never raises: a missing
    library, driver or device puts the source in CPU mode (:attr:`available` False,
    :attr:`reason` why), and an NVML error at a later sample gives a CPU-mode sample with
    the error as its reason (the next sample tries again). Where pynvml is installed but
    NVML or the GPU could not be opened (the driver still loading at login, a GPU behind
    a switch), a sample tries to open it again every :data:`REOPEN_INTERVAL_S` seconds,
    so a GPU that appears later is watched without a restart.
    """

    def __init__(
        self,
        index: int = 0,
        *,
        own_pids: Callable[[], Iterable[int]] | Iterable[int] | None = None,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
        proc_name: Callable[[int], str] = proc_name,
    ) -> None:
        self.index = index
        self._own = own_pids if own_pids is not None else (os.getpid(),)
        self._clock = clock
        self.proc_name = proc_name
        self._nvml = nvml
        self._handle = None
        self._name = ""
        self.reason = ""
        self._closed = False
        self._opened_at = clock()
        self._open()

    def _open(self) -> None:
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.reason = (
                    "no GPU, CPU mode: the NVIDIA management library (pynvml) is not installed"
                )
                return
            self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            self.reason = (
                f"no GPU, CPU mode: NVML is not available ({exc}); no NVIDIA driver or GPU"
            )
            return
        try:
            count = nvml.nvmlDeviceGetCount()
            if self.index >= count:
                self.reason = (
                    f"no GPU, CPU mode: NVML sees {count} GPU(s), none with index {self.index}"
                )
                self._shutdown()
                return
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
            name = nvml.nvmlDeviceGetName(self._handle)
            self._name = f"{name.decode() if isinstance(name, bytes) else name} (GPU {self.index})"
        except Exception as exc:
            self.reason = f"no GPU, CPU mode: NVML could not open GPU {self.index} ({exc})"
            self._handle = None
            self._shutdown()

    simulated = False

    @property
    def available(self) -> bool:
        """Whether a GPU is being watched (False: CPU mode, :attr:`reason` says why)."""
        return self._handle is not None

    def sample(self) -> VramSample:
        """The GPU's memory now (a CPU-mode sample when unavailable). Never raises."""
        now = self._clock()
        if self._handle is None and self._reopen_due(now):
            self._opened_at = now
            self._open()
        if self._handle is None:
            return cpu_mode_sample(self.reason, now)
        nvml, handle = self._nvml, self._handle
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            procs: dict[int, int] = {}
            for getter in (
                nvml.nvmlDeviceGetComputeRunningProcesses,
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                try:
                    for p in getter(handle):
                        procs[p.pid] = max(procs.get(p.pid, 0), int(p.usedGpuMemory or 0))
                except Exception:  # not supported on this driver or device
                    pass
            try:
                display = bool(nvml.nvmlDeviceGetDisplayActive(handle)) or bool(
                    nvml.nvmlDeviceGetDisplayMode(handle)
                )
            except Exception:
                display = False
            used = int(mem.used)
            ours, others, listed, top = split_by_owner(procs, _pid_set(self._own), used, self.proc_name)
            return VramSample(
                timestamp=now,
                gpu=True,
                device=self._name,
                total_bytes=int(mem.total),
                free_bytes=int(mem.free),
                ours_bytes=ours,
                others_bytes=others,
                display_attached=display,
                top_consumers=top,
                processes=listed,
                pids_visible=bool(procs) or used == 0,
            )
        except Exception as exc:
            return cpu_mode_sample(
                f"no GPU, CPU mode: NVML failed to read GPU {self.index} ({exc})", now
            )

    def _reopen_due(self, now: float) -> bool:
        # Without pynvml no retry can help; after close() none is wanted.
        return (
            self._nvml is not None
            and not self._closed
            and now - self._opened_at >= REOPEN_INTERVAL_S
        )

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def close(self) -> None:
        """Shut NVML down (a CPU-mode source has nothing to close) and stop reopening."""
        self._closed = True
        if self._handle is not None:
            self._handle = None
            self.reason = "no GPU, CPU mode: the NVML source was closed"
            self._shutdown()



async def watch(source: Any, hz: float = DEFAULT_SAMPLE_HZ) -> AsyncIterator[VramSample]:
    """Samples from ``source`` at ``hz`` per second, forever (cancel the consumer to
    stop). Each NVML read runs in a thread, so a slow driver never stalls the event
    loop. A source in CPU mode (``available`` False) yields one sample, saying why, then
    stops: there is nothing to watch. A CPU-mode sample from an available source (one
    failed NVML read) is passed on, and sampling goes on.

    Raises:
        ValueError: ``hz <= 0``.
    """
    if hz <= 0:
        raise ValueError(f"the sampling rate must be > 0 per second, got {hz}")
    period = 1.0 / hz
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        sample = await asyncio.to_thread(source.sample)
        yield sample
        if not sample.gpu and not getattr(source, "available", True):
            log.info("%s", sample.reason or "no GPU, CPU mode: nothing to watch")
            return
        await asyncio.sleep(max(period - (loop.time() - started), 0.0))
