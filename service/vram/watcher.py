"""The VRAM watcher: sample the GPU, publish ``vram`` events, replan the worker live.

When memory moves: a few times a second (``--vram-hz``) the watcher takes a
:class:`service.vram.sources.VramSample` from its source, publishes it (coalesced by the hub),
and hands it with the worker's pool (``engine.wire.ipc.PoolStats`` from its last heartbeat or
command) to :class:`service.vram.replan.ReplanController`. Each action the controller picks
goes to the worker as a typed command (``engine.wire.ipc.SetPrefillChunk``,
``ResizeExpertCache``, ``EvictPrefixCache``, ``ResizePool``, ``MoveLayers``, each with ``origin="watcher"``) and is awaited before the next sample, so every
decision sees the pool its predecessor left. Every grow carried out (the watcher's, and
the control API's through :meth:`VramWatcher.grew`) is taken from the free memory of the
samples that cannot show it yet (:mod:`service.vram.unseen`): a second grow judged
before the next sample sees the memory the first took. The worker answers with the engine's
``Replanned`` events, which :mod:`service.supervision.engine_events_to_ui` turns into
``replan`` events.

Sources (``--vram-source``):

- ``nvml`` (default): the real card (:class:`service.vram.sources.NvmlSource`); this service's
  pids are the service and its current worker. Without an NVIDIA GPU or driver it is in
  CPU mode: ``vram`` events with ``source="none"``, the reason and the host's RAM
  (``host``, about once a second: there the engine's memory is the host's), and no
  replans.
  With a GPU but an engine on the CPU, memory is shown and never replanned.
- ``simulated``: a card of ``--device-total`` whose other processes follow the
  ``--vram-timeline`` script (:mod:`service.vram.simulated`); this service's memory on it is
  what the worker's memory plan charges (fixed sizes plus the KV pool now, less the
  activation memory a lowered prefill chunk no longer needs and the expert cache slots
  given back). For tests and demos.

With ``--device-limit``, either source is read as a card of that size
(:class:`service.vram.sources.CardOfLimit`), the rule the memory plan used at start: everything
in use, other processes' memory included, counts against the limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Literal

from engine.memory.plan import fmt_bytes
from engine.wire import ipc
from engine.wire.messages import BY_WATCHER
from service.common.engine_states import State
from service.common.settings import ServeSettings
from service.events.hub import EventHub
from service.events.schemas import GpuMemory, VramEvent
from service.supervision.supervisor import Supervisor
from service.vram.gpus import GpuGroup
from service.vram.host import HOST_SAMPLE_S, host_memory
from service.vram.replan import (
    DEFAULT_HOLD_S,
    EmptyPrefixCache,
    NewChunkCap,
    NewExpertCache,
    NewPoolSize,
    PoolState,
    ReplanController,
    Squeeze,
    default_water_marks,
)
from service.vram.simulated import simulated_sources
from service.vram.sources import (
    DEFAULT_SAMPLE_HZ,
    CardOfLimit,
    NvmlSource,
    VramSample,
    nvml_index,
)
from service.vram.sources import resolve_reserve as _resolve_reserve
from service.vram.split_rung import NewSplit
from service.vram.unseen import UnseenGrows, grown_bytes

log = logging.getLogger("headroom.vram")


class VramWatcher:
    """Watches one source and replans the supervisor's worker; see the module docstring.

    Args:
        supervisor: whose worker gives memory back and takes it again.
        hub: where ``vram`` events go.
        source: ``sample()``-able (:class:`NvmlSource`, :class:`service.vram.simulated.SimulatedSource`).
        kind: ``"nvml"`` or ``"simulated"`` (the ``source`` of the ``vram`` events).
        hz: samples per second.
        reserve: ``--reserve`` in bytes, or None for auto.
        low_water_bytes, high_water_bytes: the replan band (None: from the card's size,
            :func:`service.vram.replan.default_water_marks`).
        hold_s: seconds above high water before a grow.
        command_timeout_s: how long a command to the worker may take before the watcher
            stops waiting (a long CPU step delays it; a hung worker is the watchdog's).
    """

    def __init__(
        self,
        supervisor: Supervisor,
        hub: EventHub | None,
        source: Any,
        *,
        kind: Literal["nvml", "simulated"] = "nvml",
        hz: float = DEFAULT_SAMPLE_HZ,
        reserve: int | None = None,
        low_water_bytes: int | None = None,
        high_water_bytes: int | None = None,
        hold_s: float = DEFAULT_HOLD_S,
        command_timeout_s: float = 30.0,
    ) -> None:
        self.supervisor = supervisor
        self.hub = hub
        self.source = source
        self.kind = kind
        self.hz = hz
        self.reserve = reserve
        self.low_water_bytes = low_water_bytes
        self.high_water_bytes = high_water_bytes
        self.hold_s = hold_s
        self.command_timeout_s = command_timeout_s
        self.controller: ReplanController | None = None
        # A KV pool size asked for through the control API (pages, null page included):
        # the ceiling grows stop at instead of the plan's pool. None: the plan's.
        self.kv_ceiling_pages: int | None = None
        # Likewise the expert cache's slots asked for through the control API.
        self.expert_ceiling_slots: int | None = None
        # The decoder layers on the CPU asked for through the control API: the split the
        # watcher moves layers back to instead of the start's. None: the start's.
        self.cpu_floor_layers: int | None = None
        self.latest: VramSample | None = None
        self.commands = 0  # commands sent to workers
        self._said_no_replan = False
        # One change of the worker's memory at a time: a decision and its commands, or a
        # resize asked for through the control API.
        self.lock = asyncio.Lock()
        # The grows carried out that the latest sample may not show yet.
        self.unseen = UnseenGrows()

    # -- the reserve ------------------------------------------------------------------

    def reserve_bytes(self, sample: VramSample | None = None) -> int:
        """The reserve now, in bytes (auto resolved against ``sample`` or the latest)."""
        sample = sample or self.latest
        if sample is None:
            return self.reserve or 0
        return _resolve_reserve(self.reserve, sample)

    def set_reserve(self, reserve: int | Literal["auto"]) -> str:
        """Keep ``reserve`` bytes free for the desktop from the next sample on
        (``"auto"``: 512 MiB + 5% of the card with a display, else 0). Kept in memory
        until the service stops.

        Raises:
            ValueError: a reserve as large as the card (its size, from the last sample).
        """
        card = self.latest.total_bytes if self.latest is not None and self.latest.gpu else 0
        if reserve != "auto" and card and int(reserve) >= card:
            raise ValueError(f"a reserve of {fmt_bytes(int(reserve))} leaves nothing of the card: it has "
                             f"{fmt_bytes(card)} in all; choose less than that (or \"auto\")")
        self.reserve = None if reserve == "auto" else int(reserve)
        if self.controller is not None:
            self.controller.reserve = self.reserve
        now = self.reserve_bytes()
        log.info(
            "desktop reserve set to %s (%s)",
            "auto" if self.reserve is None else fmt_bytes(self.reserve),
            fmt_bytes(now),
        )
        how = "auto: " if self.reserve is None else ""
        return f"the desktop reserve is now {how}{fmt_bytes(now)}"

    # -- grows not yet sampled ------------------------------------------------------------

    def grew(self, nbytes: int) -> None:
        """The worker's device memory grew by ``nbytes`` (a command carried out): the
        samples read before it are judged without that memory."""
        self.unseen.add(nbytes)

    def expected(self, sample: VramSample | None = None) -> VramSample | None:
        """``sample`` (default: the latest) less the grows it cannot show yet: what the
        next decision, or a person's grow (:mod:`service.vram.room`), is judged on."""
        sample = sample or self.latest
        return None if sample is None else self.unseen.expected(sample)

    # -- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Sample, publish and replan until cancelled; in CPU mode, publish the host's
        memory once a second instead (with a hub; without one, return after the one
        sample that says so)."""
        from service.vram.sources import watch

        reader = _EpochReader(self)
        while True:
            async for sample in watch(reader, self.hz):
                self.latest = sample
                self.unseen.note(sample, reader.epoch)
                reserve = self.reserve_bytes(sample)
                if not sample.gpu:  # CPU mode (watch logs why): nothing to replan
                    self._publish_cpu_mode(sample)
                    continue
                if self.hub is not None:
                    self.hub.publish(self.event(sample, reserve))
                try:
                    await self.step(sample)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("replanning failed; the watcher goes on")
            if self.latest is None or self.latest.gpu or self.hub is None:
                return
            await self._host_memory_until_a_gpu_appears()

    async def _host_memory_until_a_gpu_appears(self) -> None:
        """No GPU to watch: the engine's memory is the host's, and that is shown once a
        second; the source is asked again each time (an NVML source retries opening the
        driver now and then), and a GPU that appears is watched from then on."""
        while True:
            await asyncio.sleep(HOST_SAMPLE_S)
            sample = await asyncio.to_thread(self.source.sample)
            if sample.gpu:
                log.info("a GPU is now visible: %s; watching its memory", sample.device)
                return
            self.latest = sample
            self._publish_cpu_mode(sample)

    def event(self, sample: VramSample, reserve: int | None = None) -> VramEvent:
        """The ``vram`` event of ``sample``: its fields the tightest GPU's, ``gpus`` every
        GPU's with the reserve resolved against each card (``reserve``: the tightest
        one's, when already known)."""
        reserve = self.reserve_bytes(sample) if reserve is None else reserve
        gpus = None
        if sample.gpus:
            gpus = [GpuMemory.from_sample(s, self.reserve_bytes(s), rank) for rank, s in enumerate(sample.gpus)]
        return VramEvent.from_sample(sample, reserve, source=self.kind, gpus=gpus)

    def _publish_cpu_mode(self, sample: VramSample) -> None:
        if self.hub is None:
            return
        sup = self.supervisor
        pids = [os.getpid(), *([sup.worker_pid] if sup.worker_alive and sup.worker_pid else [])]
        try:
            host = host_memory(pids)
        except Exception:  # the host view is a courtesy; the CPU-mode event still goes
            log.debug("could not read the host's memory", exc_info=True)
            host = None
        self.hub.publish(VramEvent.from_sample(sample, 0, source=self.kind, host=host))

    def _replans_enabled(self) -> bool:
        info = self.supervisor.info
        if self.kind == "simulated" or info is None or info.device.startswith("cuda"):
            return True
        if not self._said_no_replan:
            self._said_no_replan = True
            log.info("the engine runs on %s: GPU memory is watched, not replanned", info.device)
        return False

    def _controller(self, sample: VramSample) -> ReplanController:
        if self.controller is None:
            low, high = default_water_marks(sample.total_bytes)
            low = low if self.low_water_bytes is None else self.low_water_bytes
            high = high if self.high_water_bytes is None else self.high_water_bytes
            if high <= low:
                high = low + (high if self.high_water_bytes is not None else 256 << 20)
            self.controller = ReplanController(
                low_water_bytes=low, high_water_bytes=high, hold_s=self.hold_s, reserve=self.reserve
            )
            log.info(
                "replanning between %s and %s of headroom (hold %.1f s)",
                fmt_bytes(low),
                fmt_bytes(high),
                self.hold_s,
            )
        return self.controller

    def pool_state(self, pool: ipc.PoolStats) -> PoolState:
        """The controller's view of the worker's pool, expert cache and split; grows stop
        at the sizes asked for through the control API, if any (and layers come back to
        the split asked for)."""
        ceiling = pool.planned_pages if self.kv_ceiling_pages is None else self.kv_ceiling_pages
        slots = pool.planned_expert_slots if self.expert_ceiling_slots is None else self.expert_ceiling_slots
        state = PoolState.from_stats(
            pool,
            planned_pages=max(ceiling, pool.min_pages),
            planned_expert_slots=min(slots, pool.max_expert_slots),
        )
        if self.cpu_floor_layers is None:
            return state
        return dataclasses.replace(state, planned_cpu_layers=min(self.cpu_floor_layers, pool.max_cpu_layers))

    async def step(self, sample: VramSample) -> list[Any]:
        """One decision on ``sample``, carried out; returns the actions taken."""
        sup = self.supervisor
        if sup.state is not State.READY or sup.link.pool is None or not self._replans_enabled():
            return []
        async with self.lock:
            pool = sup.link.pool
            if pool is None:
                return []
            actions = self._controller(sample).decide(self.unseen.expected(sample), self.pool_state(pool))
            for action in actions:
                if isinstance(action, Squeeze):
                    log.warning("%s", action.message)
                    continue
                if not await self._apply(action):
                    break
            return actions

    async def _apply(self, action: Any) -> bool:
        if isinstance(action, NewChunkCap):
            kind, fields = ipc.SetPrefillChunk, {"tokens": action.tokens}
        elif isinstance(action, NewExpertCache):
            kind, fields = ipc.ResizeExpertCache, {"num_slots": action.num_slots}
        elif isinstance(action, EmptyPrefixCache):
            kind, fields = ipc.EvictPrefixCache, {}
        elif isinstance(action, NewPoolSize):
            kind, fields = ipc.ResizePool, {"num_pages": action.num_pages}
        elif isinstance(action, NewSplit):
            kind, fields = ipc.MoveLayers, {"cpu_layers": action.cpu_layers}
        else:  # pragma: no cover - a new action kind
            log.error("unknown replan action %r", action)
            return False
        self.commands += 1
        before = self.supervisor.link.pool
        done = await self.supervisor.link.run_command(
            kind, timeout_s=self.command_timeout_s, reason=action.reason, origin=BY_WATCHER, **fields
        )
        if done is None:
            log.warning("the worker did not carry out %s (gone, or busy too long)", kind.__name__)
            return False
        if not done.ok:
            log.warning("the worker could not carry out %s: %s", kind.__name__, done.message)
            return False
        if before is not None:
            self.grew(grown_bytes(action, before))
        return True


class _EpochReader:
    """The watcher's source as :func:`service.vram.sources.watch` reads it, noting the
    grow epoch at which each read begins (``epoch``: the last read's)."""

    def __init__(self, watcher: VramWatcher) -> None:
        self.watcher = watcher
        self.epoch = 0

    @property
    def available(self) -> bool:
        return getattr(self.watcher.source, "available", True)

    def sample(self) -> VramSample:
        self.epoch = self.watcher.unseen.epoch
        return self.watcher.source.sample()


def _cuda_index(device: str) -> int:
    if device.startswith("cuda:"):
        try:
            return int(device.split(":", 1)[1])
        except ValueError:
            return 0
    return 0


def make_watcher(settings: ServeSettings, supervisor: Supervisor, hub: EventHub) -> VramWatcher:
    """The watcher ``settings`` ask for (``--vram-source`` and its options): one source,
    or with ``--tensor-parallel-size N`` on GPUs (or a simulated card) one per rank, read
    as the tightest (:class:`service.vram.gpus.GpuGroup`).

    Raises:
        TimelineError: a ``--vram-timeline`` that cannot be read or used.
    """
    ranks = _watched_ranks(settings)
    if settings.vram_source == "simulated":
        sources = simulated_sources(settings, supervisor, ranks)
        kind: Literal["nvml", "simulated"] = "simulated"
    else:

        def own_pids() -> set[int]:
            # The service, its worker and, under tensor parallelism, the worker's ranks.
            pids = {os.getpid()}
            if supervisor.worker_pid is not None:
                pids.add(supervisor.worker_pid)
            pids.update(getattr(supervisor, "rank_pids", ()))
            return pids

        first = _cuda_index(settings.device) if ranks == 1 else 0  # rank r runs on cuda:r
        sources = [NvmlSource(nvml_index(first + r), own_pids=own_pids) for r in range(ranks)]
        kind = "nvml"
    if settings.device_limit is not None:
        # One rule with the plan: a card of that size, others' memory counting against it.
        sources = [CardOfLimit(s, settings.device_limit) for s in sources]
    group = GpuGroup(sources) if ranks > 1 else None
    watcher = VramWatcher(
        supervisor,
        hub,
        group or sources[0],
        kind=kind,
        hz=settings.vram_hz,
        reserve=settings.reserve,
        low_water_bytes=settings.replan_low,
        high_water_bytes=settings.replan_high,
        hold_s=settings.replan_hold,
    )
    if group is not None:
        group.reserve_of = watcher.reserve_bytes
    return watcher


def _watched_ranks(settings: ServeSettings) -> int:
    """How many GPUs to watch: one per rank of a tensor-parallel worker on GPUs or on a
    simulated card; one otherwise (ranks on the CPU leave the GPUs alone)."""
    world = settings.tensor_parallel_size
    if world > 1 and (settings.vram_source == "simulated" or settings.device != "cpu"):
        return world
    return 1


