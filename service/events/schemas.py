"""The events of the control plane and the frames of ``/api/events``, as msgspec structs.

Everything the UI shows arrives as one of the event structs below, tagged by ``type``
in JSON: ``health``, ``worker``, ``engine``, ``vram``, ``plan``, ``replan``,
``request_error``, ``counters``; a new subscriber first gets a :class:`Snapshot`.
:mod:`service.events.hub` stamps each event with ``seq`` and ``ts`` and fans it out;
:mod:`service.events.export_schema` exports these types for ``ui-bridge/``. Also the
WebSocket close codes and the hub's default sizes.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, get_args

import msgspec

from engine.common.units import fmt_bytes
from engine.memory.plan import MemoryPlan
from engine.wire.messages import EngineInfo, EngineStats, OomEvent

log = logging.getLogger("headroom.events")


# WebSocket close codes of /api/events (4000-4999 are the application's own).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the service is shutting down
CLOSE_UNAUTHORIZED = 4001  # no token, or a wrong one: reconnecting will not help
CLOSE_ORIGIN_REFUSED = 4003  # the page's Origin is not on the allow-list
CLOSE_TOO_SLOW = 4008  # the client read too slowly; its queue overflowed

DEFAULT_BUFFER_SIZE = 1024  # events kept for resume
DEFAULT_QUEUE_SIZE = 256  # events waiting per subscriber before it is dropped
DEFAULT_KEEP_REQUEST_ERRORS = 50  # request errors in a snapshot
DEFAULT_KEEP_REPLANS = 20  # replans in a snapshot

HealthStatus = Literal[
    "starting",
    "ready",
    "restarting",
    "failed",
    "stopped",
    "waiting_for_memory",
    "waiting_for_gpu",
    "paused",
    "idle",
]
WorkerPhase = Literal["started", "exited", "restarting", "failed"]
VramSource = Literal["nvml", "simulated", "none"]


# -- events -------------------------------------------------------------------------------


class EventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Fields of every event. ``seq`` and ``ts`` are set by :meth:`EventHub.publish`
    (leave them 0); ``seq`` counts from 1 per hub (see ``Snapshot.epoch``), ``ts`` is
    Unix seconds."""

    seq: int = 0
    ts: float = 0.0


class Consumer(msgspec.Struct, frozen=True):
    """A process holding device memory: ``pid``, process ``name``, ``bytes``."""

    pid: int
    name: str
    bytes: int


class MemoryNeed(msgspec.Struct, frozen=True, kw_only=True):
    """What ``waiting_for_memory`` waits for, in bytes: ``needed_bytes`` free on the card
    for the plan to fit, ``free_bytes`` now, ``short_bytes`` the difference, the largest
    other consumers now, and ``waiting_s`` seconds waited so far."""

    needed_bytes: int
    free_bytes: int
    short_bytes: int
    top_consumers: list[Consumer]
    waiting_s: float = 0.0


class HealthEvent(EventBase, frozen=True, kw_only=True, tag="health"):
    """The service's readiness, as ``/api/health`` reports it.

    ``status``: ``ready`` only while a worker serves. ``reason`` says why for
    ``failed``, ``waiting_for_memory``, ``waiting_for_gpu`` (with what helps),
    ``paused`` and ``idle``; ``retry_after_s`` is the expected wait (whole seconds)
    while starting, restarting, waiting, paused or idle. ``memory`` is set in
    ``waiting_for_memory``. ``model`` is the served model's name once one was loaded.
    """

    status: HealthStatus
    model: str | None = None
    reason: str | None = None
    retry_after_s: int | None = None
    worker_pid: int | None = None
    restarts: int = 0
    memory: MemoryNeed | None = None

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> HealthEvent:
        """From ``Supervisor.health()``'s dict (``status``, ``model``, ``reason``,
        ``retry_after_s``, ``worker_pid``, ``restarts``; other keys are ignored)."""
        return cls(
            status=report["status"],
            model=report.get("model"),
            reason=report.get("reason"),
            retry_after_s=report.get("retry_after_s"),
            worker_pid=report.get("worker_pid"),
            restarts=int(report.get("restarts", 0)),
            memory=msgspec.convert(report["memory"], MemoryNeed) if report.get("memory") else None,
        )


class WorkerEvent(EventBase, frozen=True, kw_only=True, tag="worker"):
    """A change in the engine worker process's life.

    ``started``: spawned, ``pid`` set. ``exited``: ended; ``exit_code`` (None when
    killed by a signal), ``signal`` (its name, e.g. ``"SIGKILL"``, or None), ``reason``
    (e.g. ``"was killed by SIGKILL"``) and its ``last_lines`` of output. ``restarting``: a new worker follows in ``delay_s``
    seconds. ``failed``: no more restarts (``reason`` says why) until one is asked for.
    ``restarts`` counts the restarts after a crash or a hang since the service started
    (a restart asked for through the control API is not counted).
    """

    phase: WorkerPhase
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    delay_s: float | None = None
    restarts: int = 0
    last_lines: list[str] = []


class EngineInfoEvent(EventBase, frozen=True, kw_only=True, tag="engine"):
    """Facts about the engine a worker loaded (model, device, dtype, context, KV pages),
    sent when a worker becomes ready. Publish it with ``info.plan`` set to None: the
    plan travels in ``plan`` events."""

    info: EngineInfo


class HostMemory(msgspec.Struct, frozen=True, kw_only=True):
    """The host's RAM, in bytes: ``total_bytes``, ``available_bytes`` (what new
    allocations can take without swapping) and ``ours_bytes`` (the resident set of this
    service's processes)."""

    total_bytes: int
    available_bytes: int
    ours_bytes: int


class GpuMemory(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU's memory, in bytes, as in :class:`VramEvent`: ``rank`` is the
    tensor-parallel rank whose device it is (0 for a single GPU), the other fields mean
    what :class:`VramEvent`'s of the same names mean, for this card."""

    rank: int
    device: str
    total_bytes: int
    free_bytes: int
    ours_bytes: int
    others_bytes: int
    reserve_bytes: int
    headroom_bytes: int
    device_limit_bytes: int | None = None

    @classmethod
    def from_sample(cls, sample: Any, reserve_bytes: int, rank: int = 0) -> GpuMemory:
        """From one GPU's sample (``service.vram.sources.VramSample``)."""
        device = str(getattr(sample, "device", "") or "GPU")
        return cls(rank=rank, device=device, **card_figures(sample, reserve_bytes))


def card_figures(sample: Any, reserve_bytes: int) -> dict[str, Any]:
    """The byte figures :class:`GpuMemory` and :class:`VramEvent` both carry, from a
    sample: its total, free, ours, others' and ``--device-limit`` bytes as they are,
    ``reserve_bytes``, and ``headroom_bytes = free - reserve``."""
    free, reserve = int(sample.free_bytes), int(reserve_bytes)
    return {
        "total_bytes": int(sample.total_bytes),
        "free_bytes": free,
        "ours_bytes": int(sample.ours_bytes),
        "others_bytes": int(sample.others_bytes),
        "reserve_bytes": reserve,
        "headroom_bytes": free - reserve,
        "device_limit_bytes": getattr(sample, "device_limit_bytes", None),
    }


class VramEvent(EventBase, frozen=True, kw_only=True, tag="vram"):
    """The device's memory now, in bytes.

    ``gpus`` lists every GPU the worker runs on, one entry per tensor-parallel rank's
    device in rank order (one entry for a single GPU; empty in CPU mode). The other
    fields are those of the *tightest* GPU: the one with the least headroom, which sizes
    the group's KV pool and which the replans follow (with one GPU, that GPU).

    ``ours_bytes`` is held by this service's processes, ``others_bytes`` by everyone
    else; ``free_bytes`` is what the device has free; ``reserve_bytes`` is kept for the
    desktop; ``headroom_bytes = free_bytes - reserve_bytes`` (negative when the desktop
    is already short). ``source`` is ``nvml``, ``simulated``, or ``none`` (no GPU: CPU
    mode, all sizes 0, ``reason`` says why). ``top_consumers`` lists the largest other
    processes.

    ``device_limit_bytes`` is ``--device-limit`` where it is smaller than the card, and
    ``memory_rule`` says for people which rule reads the card (the same one the memory
    plan used at start): a card of the limit's size, against which other processes'
    memory counts, or the whole card.
    """

    device: str
    source: VramSource
    total_bytes: int
    free_bytes: int
    ours_bytes: int
    others_bytes: int
    reserve_bytes: int
    headroom_bytes: int
    top_consumers: list[Consumer] = []
    reason: str | None = None
    device_limit_bytes: int | None = None
    memory_rule: str | None = None
    host: HostMemory | None = None
    gpus: list[GpuMemory] = []

    @classmethod
    def from_sample(
        cls,
        sample: Any,
        reserve_bytes: int,
        *,
        source: VramSource = "nvml",
        host: HostMemory | None = None,
        gpus: list[GpuMemory] | None = None,
    ) -> VramEvent:
        """From the watcher's sample (``service.vram.sources.VramSample`` or anything with its
        fields: ``gpu``, ``device``, ``total_bytes``, ``free_bytes``, ``ours_bytes``,
        ``others_bytes``, ``top_consumers`` of ``pid``/``name``/``bytes``, ``reason``).
        A sample with ``gpu`` False becomes ``source="none"`` (CPU mode); ``host``: the
        host's RAM to send with it. ``gpus``: every GPU's entry (None: the sample's own
        GPU as the one entry, none in CPU mode)."""
        gpu = bool(getattr(sample, "gpu", True))
        if gpus is None:
            gpus = [GpuMemory.from_sample(sample, reserve_bytes)] if gpu else []
        return cls(
            device=str(getattr(sample, "device", "") or ("no GPU" if not gpu else "GPU")),
            source=source if gpu else "none",
            **card_figures(sample, reserve_bytes),
            top_consumers=[
                Consumer(int(p.pid), str(p.name), int(p.bytes))
                for p in getattr(sample, "top_consumers", ())
            ],
            reason=getattr(sample, "reason", None) or None,
            memory_rule=memory_rule(getattr(sample, "device_limit_bytes", None)) if gpu else None,
            host=host,
            gpus=gpus,
        )


def memory_rule(device_limit_bytes: int | None) -> str:
    """The rule by which the plan, the watcher and the replan controller read the card."""
    if device_limit_bytes is None:
        return "the whole card; other processes' memory counts against it"
    return (
        f"a card of {fmt_bytes(device_limit_bytes)} (--device-limit): other processes' "
        f"memory counts against it, as on a real card of that size"
    )


class PlanEvent(EventBase, frozen=True, kw_only=True, tag="plan"):
    """The worker's memory plan (the ledger of every byte); ``plan`` is null when the
    KV cache size was fixed by a flag and no plan was made."""

    plan: MemoryPlan | None


class PlanPoint(msgspec.Struct, frozen=True, kw_only=True):
    """The sizes a replan moves: the KV pool (bytes and usable pages), the prefill
    chunk cap (tokens), the prefix cache's pages (None when unknown) and the GPU expert
    cache in front of routed experts in host memory (slots over all its layers and
    their bytes; None when every expert is on the device); the last decoder layers the
    CPU runs (``--cpu-layers``; on every event of an engine whose split can move or is
    split; None for one whose layers all stay on the device throughout)."""

    kv_pool_bytes: int
    num_pages: int
    max_prefill_tokens: int
    prefix_cache_pages: int | None = None
    expert_cache_slots: int | None = None
    expert_cache_bytes: int | None = None
    cpu_layers: int | None = None


class ReplanEvent(EventBase, frozen=True, kw_only=True, tag="replan"):
    """The plan changed while serving. ``action`` names the step (e.g.
    ``lower_chunk_cap``, ``evict_prefix_cache``, ``shrink_expert_cache``,
    ``grow_expert_cache``, ``shrink_kv``, ``grow_kv``, ``set_kv_cache``,
    ``set_expert_cache``, ``move_layers_to_cpu``, ``move_layers_to_device``,
    ``set_cpu_layers``); ``reason``
    says why for people; ``duration_s`` how long it took.
    """

    action: str
    reason: str
    before: PlanPoint
    after: PlanPoint
    duration_s: float | None = None


class RequestErrorEvent(EventBase, frozen=True, kw_only=True, tag="request_error"):
    """A request hit an error inside the engine (the engine stayed up).

    ``code`` e.g. ``out_of_memory``; ``phase`` where (``prefill``, ``decode``,
    ``sample``); ``action`` what was done (``failed``, ``retry_smaller_chunk``,
    ``preempted``, ``retry``); ``bytes_asked`` the failed allocation's size and
    ``headroom_bytes`` the device's headroom at the time, when known.
    """

    request_id: str
    code: str
    message: str
    action: str
    phase: str | None = None
    bytes_asked: int | None = None
    headroom_bytes: int | None = None

    @classmethod
    def from_oom(
        cls,
        event: OomEvent,
        *,
        bytes_asked: int | None = None,
        headroom_bytes: int | None = None,
    ) -> RequestErrorEvent:
        """From the engine's :class:`engine.wire.messages.OomEvent`."""
        return cls(
            request_id=event.request_id,
            code="out_of_memory",
            message=event.message,
            action=event.action,
            phase=event.phase,
            bytes_asked=bytes_asked,
            headroom_bytes=headroom_bytes,
        )


class CountersEvent(EventBase, frozen=True, kw_only=True, tag="counters"):
    """Counters: the engine's (``engine``, null when no worker answers) and the
    service's: sequences in flight, out-of-memory steps (each rolled back), requests
    they failed, replans."""

    engine: EngineStats | None = None
    in_flight: int = 0
    oom_steps: int = 0
    oom_failed_requests: int = 0
    replans: int = 0


Event = (
    HealthEvent
    | WorkerEvent
    | EngineInfoEvent
    | VramEvent
    | PlanEvent
    | ReplanEvent
    | RequestErrorEvent
    | CountersEvent
)
EVENT_TYPES: tuple[type[EventBase], ...] = get_args(Event)


class Snapshot(EventBase, frozen=True, kw_only=True, tag="snapshot"):
    """Everything the UI shows, at ``seq`` (the last event it includes; the next event
    has ``seq + 1``). ``epoch`` names this hub (a new one per service start): resume
    only with the epoch the ``seq`` came from. Each field holds the latest event of its
    kind (null before the first), ``last_exit`` the latest ``worker`` event of phase
    ``exited`` (code, signal, reason survive the restart); ``request_errors`` and
    ``replans`` the newest ones, oldest first. This is also the body of
    ``GET /api/status``."""

    epoch: str
    health: HealthEvent | None = None
    worker: WorkerEvent | None = None
    last_exit: WorkerEvent | None = None
    engine: EngineInfoEvent | None = None
    plan: PlanEvent | None = None
    vram: VramEvent | None = None
    counters: CountersEvent | None = None
    request_errors: list[RequestErrorEvent] = []
    replans: list[ReplanEvent] = []


ServerMessage = Snapshot | Event
"""Every text frame ``/api/events`` sends is one of these, as JSON."""

_encoder = msgspec.json.Encoder()
message_decoder = msgspec.json.Decoder(ServerMessage)


def encode(message: ServerMessage) -> str:
    """A message as the JSON text of one WebSocket frame."""
    return _encoder.encode(message).decode()
