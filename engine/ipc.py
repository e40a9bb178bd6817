"""Messages between the service and its engine worker, and the worker's start config.

Torch-free msgspec structs: both processes import this module. Every message crosses
the duplex pipe as one msgpack frame (``Connection.send_bytes``); ``encode`` and the
two decoders below are the only (de)serializers, so a field added here reaches both
sides at once.

Service -> worker: :class:`engine.messages.GenerateRequest`,
:class:`engine.messages.AbortRequest`, :class:`StatsRequest`, :class:`Shutdown`.

Worker -> service: :class:`Ready` (once, after the model is loaded), :class:`Outputs`,
:class:`Rejected`, :class:`Heartbeat`, :class:`EngineEvents` (what the engine did about
an out-of-memory step), :class:`WorkerError` (then the worker exits).
"""

from __future__ import annotations

import msgspec

from engine.config import EngineConfig
from engine.messages import (
    AbortRequest,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    OomEvent,
    ReplanWanted,
    TokenOutput,
)


class StatsRequest(msgspec.Struct, frozen=True, tag=True):
    """Ask for a :class:`Heartbeat` now, echoing ``seq``, so a caller gets fresh
    counters instead of the last periodic ones."""

    seq: int


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Finish nothing, exit now (code 0). Closing the pipe has the same effect."""


class Ready(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The engine is loaded and accepts requests.

    ``load_s`` is the wall time from the worker's start to this message, in seconds.
    """

    info: EngineInfo
    pid: int
    load_s: float


class Outputs(msgspec.Struct, frozen=True, tag=True):
    """The token outputs of one engine step (one entry per request it touched)."""

    outputs: list[TokenOutput]


class Rejected(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """``Engine.add_request`` refused a request (:class:`engine.errors.RequestRejected`);
    it never ran and yields no :class:`Outputs`."""

    request_id: str
    message: str
    code: str
    param: str | None = None


class Heartbeat(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Sent from the worker's main loop every ``heartbeat_interval_s`` (and in answer
    to a :class:`StatsRequest`, with its ``seq``). It comes from the same thread that
    runs engine steps, so its absence means the loop is stuck, not merely busy with
    a thread of its own."""

    stats: EngineStats
    seq: int | None = None


class EngineEvents(msgspec.Struct, frozen=True, tag=True):
    """The engine's events of one step (``Engine.drain_events()``), in order: an
    :class:`engine.messages.OomEvent` per out-of-memory step (the request it hit and
    what was done: retried smaller, preempted, retried, or failed), then at most one
    :class:`engine.messages.ReplanWanted`. Sent right after that step's
    :class:`Outputs`, only when there are any."""

    events: list[OomEvent | ReplanWanted]


class WorkerError(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The worker is about to exit because of an error.

    ``during_load`` is true when the engine never became ready (model missing,
    unsupported architecture, a plan that does not fit): restarting will not help.
    ``kind`` is the exception's class name; ``message`` its text.
    """

    message: str
    kind: str
    during_load: bool


ToWorker = GenerateRequest | AbortRequest | StatsRequest | Shutdown
FromWorker = Ready | Outputs | Rejected | Heartbeat | EngineEvents | WorkerError

_encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode(message: ToWorker | FromWorker) -> bytes:
    """One message as a msgpack frame."""
    return _encoder.encode(message)


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker needs to start, fixed for its lifetime.

    ``engine`` is the engine's own config. ``heartbeat_interval_s`` is how often the
    worker's loop reports (seconds). ``parent_pid`` is the service's pid: the worker
    exits when its parent changes (the parent died and it was re-parented).
    ``engine_factory`` is ``"module:callable"`` returning an object with the
    :class:`engine.engine.Engine` API; tests point it at a fake engine.
    """

    engine: EngineConfig
    parent_pid: int
    heartbeat_interval_s: float = 0.5
    engine_factory: str = "engine.engine:Engine"
