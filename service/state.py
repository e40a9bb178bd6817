"""What the routes share: settings, the supervisor, the tokenizer side.

One :class:`Services` object per app, handed to route handlers by Litestar's
dependency injection (parameter name ``svc``), never through module globals.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from engine.messages import OOM_FAILED, EngineEvent, EngineInfo, OomEvent, ReplanWanted
from service.errors import APIError
from service.settings import ServeSettings
from service.supervisor import Supervisor
from service.text import TextSide

# How many request errors /api/status keeps (the newest).
KEEP_REQUEST_ERRORS = 50


class RequestError(msgspec.Struct, frozen=True, kw_only=True):
    """A request the engine failed on its own (the engine stayed up), as
    ``/api/status`` lists it (and, later, a ``request_error`` event).

    ``at`` is the time in Unix seconds; ``request_id`` the engine's id
    (``{api id}-{sequence}``); ``code`` e.g. ``"out_of_memory"``; ``phase`` where it
    failed (``prefill``, ``decode``, ``sample``); ``message`` for people.
    """

    at: float
    request_id: str
    code: str
    message: str
    phase: str | None = None


class EngineEventCounts(msgspec.Struct, kw_only=True):
    """Engine events since the service started: out-of-memory steps (each rolled back),
    requests failed by them, and replans asked for; ``last_replan`` is the latest."""

    oom_steps: int = 0
    oom_failed_requests: int = 0
    replans_wanted: int = 0
    last_replan: ReplanWanted | None = None


@dataclass
class Services:
    """The app's shared objects. ``text`` is set once a worker is ready and reloaded
    only when a restarted worker serves another model folder. ``started_at`` is the
    service's start, in Unix seconds (the ``created`` of ``/v1/models``).
    ``request_errors`` holds the last :data:`KEEP_REQUEST_ERRORS` requests the engine
    failed, oldest first; ``engine_events`` counts what the engine reported."""

    settings: ServeSettings
    supervisor: Supervisor
    text: TextSide | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    request_errors: deque[RequestError] = field(
        default_factory=lambda: deque(maxlen=KEEP_REQUEST_ERRORS)
    )
    engine_events: EngineEventCounts = field(default_factory=EngineEventCounts)

    def record_engine_event(self, event: EngineEvent) -> None:
        """Called by the supervisor for each engine event (already logged there)."""
        counts = self.engine_events
        if isinstance(event, OomEvent):
            counts.oom_steps += 1
            if event.action == OOM_FAILED:
                counts.oom_failed_requests += 1
                self.request_errors.append(
                    RequestError(
                        at=time.time(),
                        request_id=event.request_id,
                        code="out_of_memory",
                        message=event.message,
                        phase=event.phase,
                    )
                )
        elif isinstance(event, ReplanWanted):
            counts.replans_wanted += 1
            counts.last_replan = event

    def model_names(self, info: EngineInfo) -> list[str]:
        """Names the served model answers to: the engine's, then configured aliases."""
        return [info.model_name, *self.settings.served_model_name]

    def check_model(self, requested: str | None, info: EngineInfo) -> str:
        """The model name to report for a request naming ``requested``.

        An absent or empty name means the served model (there is only one).

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        names = self.model_names(info)
        if not requested or requested in names:
            return names[0]
        raise APIError(
            404,
            f"The model `{requested}` does not exist; this server serves "
            + ", ".join(f"`{n}`" for n in names),
            param="model",
            code="model_not_found",
        )

    async def prepare(self, info: EngineInfo) -> None:
        """Called by the supervisor when a worker is ready: load its tokenizer."""
        if self.text is None or self.text.model_dir != info.model_dir:
            old, self.text = self.text, await TextSide.load(info.model_dir)
            if old is not None:
                old.close()
