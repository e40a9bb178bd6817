"""``GET /api/health`` and ``GET /api/status``: is the engine serving, its plan and counters.

Health answers 200 ``{"status": "ready", ...}`` only while a worker is ready;
otherwise 503 with ``status`` ``starting``, ``restarting`` (with Retry-After) or
``failed`` (with ``reason`` and the last exit's code, signal and output lines).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Response, get

from service.state import Services
from service.supervisor import State


def _info_dict(svc: Services) -> dict[str, Any] | None:
    """The engine's facts without the plan (shown on its own)."""
    info = svc.supervisor.info
    if info is None:
        return None
    facts = msgspec.to_builtins(info)
    facts.pop("plan", None)
    return facts


def _plan_dict(svc: Services) -> dict[str, Any] | None:
    info = svc.supervisor.info
    return None if info is None or info.plan is None else msgspec.to_builtins(info.plan)


class HealthController(Controller):
    path = "/api"

    @get("/health")
    async def health(self, svc: Services) -> Response[dict[str, Any]]:
        """200 when ready, else 503; the body says which state and why."""
        report = svc.supervisor.health()
        if svc.supervisor.state is State.READY:
            return Response(report, status_code=200)
        headers = {}
        if report.get("retry_after_s") is not None:
            headers["Retry-After"] = str(report["retry_after_s"])
        return Response(report, status_code=503, headers=headers)

    @get("/status")
    async def status(self, svc: Services) -> dict[str, Any]:
        """Worker state, the engine's facts, its memory plan (the ledger; null when the
        KV cache size was fixed or no device was planned for), its counters read now
        (``stats`` is null when no worker answers within 2 s), the engine's events and
        the last requests it failed (``request_errors``, oldest first)."""
        stats = await svc.supervisor.fresh_stats()
        return {
            "worker": svc.supervisor.health(),
            "engine": _info_dict(svc),
            "plan": _plan_dict(svc),
            "stats": None if stats is None else msgspec.to_builtins(stats),
            "engine_events": msgspec.to_builtins(svc.engine_events),
            "request_errors": msgspec.to_builtins(list(svc.request_errors)),
        }
