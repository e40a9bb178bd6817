"""Messages between the service and its engine worker, and the worker's start config.

Torch-free msgspec structs: both processes import this module. Every message crosses
the duplex pipe as one msgpack frame (``Connection.send_bytes``); ``encode`` and the
two decoders below are the only (de)serializers, so a field added here reaches both
sides at once.

Service -> worker: :class:`engine.wire.messages.GenerateRequest`,
:class:`engine.wire.messages.AbortRequest`, :class:`StatsRequest`, :class:`Shutdown`, and
the live replan commands (when another process takes or frees device memory, or a
person asks): :class:`SetPrefillChunk`, :class:`EvictPrefixCache`, :class:`ResizePool`,
:class:`ResizeExpertCache`, :class:`MoveLayers`,
each saying who asked (``origin``).

Worker -> service: :class:`ModelFolder` (once, before the weights load), :class:`Ready`
(once, after the model is loaded), :class:`Outputs`,
:class:`Rejected`, :class:`Heartbeat` (with the KV pool's :class:`PoolStats`),
:class:`EngineEvents` (what the engine did about an out-of-memory step, and each live
change of its memory use), :class:`ControlDone` (a replan command was carried out, after
its ``EngineEvents``), :class:`WorkerError` (then the worker exits).
"""

from __future__ import annotations

import msgspec

from engine.common.config import EngineConfig
from engine.memory.kv_fit import RingRule
from engine.wire.messages import (
    BY_WATCHER,
    AbortRequest,
    EngineEvent,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    ReplanOrigin,
    ResizeResult,
    TokenOutput,
)


class StatsRequest(msgspec.Struct, frozen=True, tag=True):
    """Ask for a :class:`Heartbeat` now, echoing ``seq``, so a caller gets fresh
    counters instead of the last periodic ones."""

    seq: int


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Finish nothing, exit now (code 0). Closing the pipe has the same effect."""


# Live replan commands. Each is carried out between two engine steps, in the order
# sent; the worker answers with the engine's events (a ``Replanned`` when something
# changed) and then a ControlDone echoing ``seq``. ``origin`` says who asked (the
# VRAM watcher or a person through the control API) and comes back in the
# ``Replanned``; ``reason`` is for people (logs, the ``replan`` event).


class SetPrefillChunk(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Set the engine-wide prefill chunk cap to ``tokens`` (``Engine.set_prefill_chunk``;
    never above what the plan fitted)."""

    seq: int
    tokens: int
    reason: str = ""
    origin: ReplanOrigin = BY_WATCHER


class EvictPrefixCache(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Free the prefix cache's unreferenced pages (``Engine.evict_prefix_cache``): to
    make room for a pool shrink (the watcher) or because a person asked (the control
    API's "clear prefix cache")."""

    seq: int
    reason: str = ""
    origin: ReplanOrigin = BY_WATCHER


class ResizePool(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Resize the KV pool to ``num_pages`` pages, the null page included
    (``Engine.resize_kv_pool``: running requests keep going)."""

    seq: int
    num_pages: int
    reason: str = ""
    origin: ReplanOrigin = BY_WATCHER


class ResizeExpertCache(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Resize the GPU expert cache in front of the routed experts in host memory to
    ``num_slots`` slots over all such layers (``Engine.resize_expert_cache``: every
    expert stays in host memory, so nothing that runs is lost; 0 leaves none on the
    device)."""

    seq: int
    num_slots: int
    reason: str = ""
    origin: ReplanOrigin = BY_WATCHER


class MoveLayers(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Run the last ``cpu_layers`` decoder layers on the CPU (``Engine.move_split``: a
    dense model of ``--cpu-layers auto`` moves its split between steps; running requests
    keep going)."""

    seq: int
    cpu_layers: int
    reason: str = ""
    origin: ReplanOrigin = BY_WATCHER


class ModelFolder(msgspec.Struct, frozen=True, tag=True):
    """The model's Hugging Face folder (the conversion of a GGUF included), resolved
    before the weights load: the service loads its tokenizer while the worker loads the
    weights, instead of after :class:`Ready` (about 0.6 s on a small model's start)."""

    model_dir: str


class Ready(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The engine is loaded and accepts requests.

    ``load_s`` is the wall time from the worker's start to this message, in seconds.
    ``rank_pids`` are the pids of a tensor-parallel worker's other ranks (its children,
    ranks 1..N-1; empty for one rank): the VRAM watcher counts their GPU memory as ours.
    """

    info: EngineInfo
    pid: int
    load_s: float
    rank_pids: list[int] = []


class Outputs(msgspec.Struct, frozen=True, tag=True):
    """The token outputs of one engine step (one entry per request it touched)."""

    outputs: list[TokenOutput]


class Rejected(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """``Engine.add_request`` refused a request (:class:`engine.common.errors.RequestRejected`);
    it never ran and yields no :class:`Outputs`."""

    request_id: str
    message: str
    code: str
    param: str | None = None


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """The KV pool and the prefill chunk as the service's replan controller needs them
    (``service.vram.replan.PoolState``). Pages count the whole pool, the null page included.

    ``pages`` is the pool now, ``planned_pages`` what the worker started with (the
    memory plan's pool), ``min_pages`` the floor (one request of the minimum context:
    ``Engine.min_kv_pool_pages()``). ``page_bytes`` is one page's device memory as the
    plan counts it (the device's real bytes on a GPU), ``pool_bytes`` the pool's buffers
    now. ``prefill_chunk`` is the chunk cap now, ``planned_prefill_chunk`` the plan's;
    ``activation_bytes_per_token`` the plan's activation peak per token of chunk (0:
    unknown). ``free_pages``/``cached_pages`` are held by nobody / only by the prefix
    cache. ``max_context_tokens`` is one request's limit now. ``fixed_bytes`` is
    everything the plan charged besides the pool (0 without a plan), the expert cache of
    ``planned_expert_slots`` included.

    The GPU expert cache (routed experts in host memory, ``--cpu-experts``; all 0
    without one): ``expert_slots`` now, ``planned_expert_slots`` the plan's (the ceiling
    to grow back to), ``max_expert_slots`` every offloaded expert cached, and
    ``expert_slot_bytes`` one slot's device bytes as the plan counts them.

    A dense model's split (``--cpu-layers``; all 0 where it cannot move): the last
    ``cpu_layers`` decoder layers run on the CPU now, ``planned_cpu_layers`` at the
    start (the floor moves back to), at most ``max_cpu_layers`` (0: the split is fixed
    or the model does not split); ``layer_bytes`` is one decoder layer's weights on the
    device as the plan counts them (the largest), ``device_layers`` the layers whose
    keys and values ``page_bytes`` covers. ``decoder_layers`` is the model's decoder
    layers, whether its split moves or not (0: not known), so a count of layers asked
    for can be checked against it. ``moe_layers`` is the model's mixture-of-experts
    layers (0: a dense model, which has no expert cache to size).

    ``ring``: for a model whose sliding-window layers keep a ring, the ring pool a KV
    pool resize sets beside each size (``Engine.ring_rule``), whose bytes the resize
    frees or takes with the pages'; None without one.
    """

    pages: int
    planned_pages: int
    min_pages: int
    page_bytes: int
    pool_bytes: int
    prefill_chunk: int
    planned_prefill_chunk: int
    min_prefill_chunk: int
    activation_bytes_per_token: int
    free_pages: int
    cached_pages: int
    max_context_tokens: int
    fixed_bytes: int = 0
    expert_slots: int = 0
    planned_expert_slots: int = 0
    max_expert_slots: int = 0
    expert_slot_bytes: int = 0
    cpu_layers: int = 0
    planned_cpu_layers: int = 0
    max_cpu_layers: int = 0
    layer_bytes: int = 0
    device_layers: int = 0
    decoder_layers: int = 0
    moe_layers: int = 0
    ring: RingRule | None = None


class Heartbeat(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Sent by the worker's heartbeat thread every ``heartbeat_interval_s``, also in the
    middle of a long step (and by its main loop in answer to a :class:`StatsRequest`,
    with its ``seq``). Its absence means the process is stopped or gone; a stuck step
    shows as ``progress`` that stops moving (the watchdog reads both,
    :mod:`service.supervision.liveness`).

    ``stats`` and ``pool`` are the main loop's last reading between two steps (a step
    is not interrupted to read them); ``pool`` is None for an engine that cannot resize
    its pool. ``progress`` is the worker's work counter
    (:mod:`engine.common.progress`: layers run, loop passes), which only grows;
    ``waiting`` says the main loop waits for messages, with no work to make progress
    on."""

    stats: EngineStats
    seq: int | None = None
    pool: PoolStats | None = None
    progress: int = 0
    waiting: bool = False


class EngineEvents(msgspec.Struct, frozen=True, tag=True):
    """The engine's events (``Engine.drain_events()``), in order: an
    :class:`engine.wire.messages.OomEvent` per out-of-memory step (the request it hit and
    what was done: retried smaller, preempted, retried, or failed), at most one
    :class:`engine.wire.messages.ReplanWanted` per step, and an
    :class:`engine.wire.messages.Replanned` per live change of its memory use. Sent right
    after a step's :class:`Outputs`, or after a replan command, only when there are
    any."""

    events: list[EngineEvent]


class ControlDone(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A replan command (``seq``) was carried out (``ok``) or refused; ``message`` says
    what happened for people. ``result`` is the resize's figures for a
    :class:`ResizePool`. ``stats`` and ``pool`` are read right after it."""

    seq: int
    ok: bool
    message: str
    stats: EngineStats
    pool: PoolStats | None = None
    result: ResizeResult | None = None


class Misfit(msgspec.Struct, frozen=True, kw_only=True):
    """The figures of a memory plan that does not fit (``engine.common.errors.PlanDoesNotFit``),
    in bytes: the card's ``total_bytes`` (``--device-limit`` applied), what other
    processes held when it was made, and the ``shortfall_bytes`` one request of the
    minimum context lacks. ``simulated``: planned for a ``--device-total`` card. When
    the shortfall is no more than the others' memory, the plan fits once they free it."""

    total_bytes: int
    others_bytes: int
    shortfall_bytes: int
    simulated: bool

    @property
    def waitable(self) -> bool:
        """Whether the plan would fit on this card without the other processes."""
        return self.others_bytes > 0 and self.shortfall_bytes <= self.others_bytes

    @property
    def needed_free_bytes(self) -> int:
        """The free memory (nothing of ours on the card) at which the plan fits."""
        return self.total_bytes - self.others_bytes + self.shortfall_bytes


class WorkerError(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The worker is about to exit because of an error.

    ``during_load`` is true when the engine never became ready (model missing,
    unsupported architecture, a plan that does not fit, CUDA that cannot start).
    ``kind`` is the exception's class name; ``message`` its text; ``misfit`` the plan's
    figures when the plan did not fit (the service waits for memory when other
    processes hold what is missing).
    """

    message: str
    kind: str
    during_load: bool
    misfit: Misfit | None = None


ReplanCommand = SetPrefillChunk | EvictPrefixCache | ResizePool | ResizeExpertCache | MoveLayers
ToWorker = (
    GenerateRequest | AbortRequest | StatsRequest | Shutdown | SetPrefillChunk | EvictPrefixCache | ResizePool
    | ResizeExpertCache | MoveLayers
)
FromWorker = ModelFolder | Ready | Outputs | Rejected | Heartbeat | EngineEvents | ControlDone | WorkerError

_encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def decode_to_worker(frame: bytes) -> ToWorker | Rejected | None:
    """One frame from the service as its message. A frame that is no valid message (a
    field of the wrong type that got past the service's checks, such as a JSON ``true``
    among a prompt's token ids) becomes a :class:`Rejected` of the request it names, for
    the worker to send back (its client gets a 400), or None when it names none: one bad
    request never takes the worker, and every other request, down.

    Raises:
        msgspec.DecodeError: the frame is not msgpack at all (a broken pipe, not a request).
    """
    try:
        return to_worker_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raw = msgspec.msgpack.decode(frame)
        request_id = raw.get("request_id") if isinstance(raw, dict) else None
        if not isinstance(request_id, str):
            return None
        return Rejected(request_id=request_id, message=f"invalid request: {exc}", code="invalid_request")


def encode(message: ToWorker | FromWorker) -> bytes:
    """One message as a msgpack frame."""
    return _encoder.encode(message)


ENGINE_FACTORY = "engine.core.engine:Engine"  # the real engine; tests name stand-ins


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker needs to start, fixed for its lifetime.

    ``engine`` is the engine's own config. ``heartbeat_interval_s`` is how often the
    worker's loop reports (seconds). ``parent_pid`` is the service's pid: the worker
    exits when its parent changes (the parent died and it was re-parented).
    ``engine_factory`` is ``"module:callable"`` returning an object with the
    :class:`engine.core.engine.Engine` API; tests point it at a fake engine.
    ``kv_pages``: the KV pool a live change kept (pages, the null page included), which
    the worker resizes its pool to once loaded where the host's memory holds it
    (:mod:`engine.worker.kept_pool`); None: the pool ``engine`` sizes. ``engine`` always
    holds the start's sizing, so ``{"kv_cache": null}`` goes back to it.
    """

    engine: EngineConfig
    parent_pid: int
    kv_pages: int | None = None
    heartbeat_interval_s: float = 0.5
    engine_factory: str = ENGINE_FACTORY
