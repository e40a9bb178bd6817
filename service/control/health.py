"""``GET /api/health``: is the engine serving.

Health answers 200 ``{"status": "ready", ...}`` while a worker is ready, and 200
``{"status": "idle", ...}`` while the model is unloaded after ``--keep-alive`` or an
Ollama unload (the service serves: the next request loads it, as Ollama's does);
otherwise 503 with ``status`` ``starting``, ``restarting`` (with Retry-After),
``paused``, ``waiting_for_memory`` or ``failed`` (with ``reason`` and the last exit's
code, signal and output lines).

``GET /api/status`` (the plan, VRAM, counters, worker and the last errors) is the
event hub's snapshot, served by :func:`service.control.routes.events_router`.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get

from service.api.services import Services
from service.common.engine_states import State
from service.supervision.report import health_report


class HealthController(Controller):
    path = "/api"

    @get("/health")
    async def health(self, svc: Services) -> Response[dict[str, Any]]:
        """200 when ready or idle (unloaded, loaded by the next request), else 503; the
        body says which state and why."""
        report = health_report(svc.supervisor)
        if svc.supervisor.state in (State.READY, State.IDLE):
            return Response(report, status_code=200)
        headers = {}
        if report.get("retry_after_s") is not None:
            headers["Retry-After"] = str(report["retry_after_s"])
        return Response(report, status_code=503, headers=headers)
