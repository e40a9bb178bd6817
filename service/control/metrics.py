"""``GET /metrics``: the app's figures in Prometheus's text format
(:mod:`service.events.metrics` declares them).

Open, as ``/api/health`` and ``/api/status`` are (also with ``--api-key``): the figures
are counts and sizes, never a prompt, a token or a path. Before each scrape the
engine's counters are read fresh from a ready worker (bounded: a worker that does not
answer leaves the last heartbeat's).
"""

from __future__ import annotations

from typing import Any

from litestar import Response, get

from service.api.services import Services
from service.common.engine_states import State
from service.events.metrics import CONTENT_TYPE, Reading
from service.supervision.engine_events_to_ui import EngineEventCounts
from service.supervision.supervisor import Supervisor

# Seconds a scrape waits for the worker's fresh counters.
FRESH_STATS_TIMEOUT_S = 2.0


def reading_of(svc: Services, counts: EngineEventCounts) -> Reading:
    """What a scrape reads now: the supervisor's state and restarts, the calls and
    sequences waiting or running, the engine's last counters and its events' counts."""
    supervisor: Supervisor = svc.supervisor
    return Reading(
        state=supervisor.state.value,
        states=tuple(s.value for s in State),
        restarts=supervisor.restarts,
        calls_waiting=svc.admission.waiting,
        sequences_in_flight=supervisor.link.in_flight,
        stats=supervisor.link.stats,
        oom_steps=counts.oom_steps,
        oom_failed_requests=counts.oom_failed_requests,
        replans=counts.replans,
    )


@get("/metrics", include_in_schema=False, name="metrics")
async def metrics_route(svc: Services) -> Response[Any]:
    """The figures in Prometheus's text format (version 0.0.4)."""
    await svc.supervisor.link.fresh_stats(FRESH_STATS_TIMEOUT_S)
    return Response(content=svc.metrics.exposition(), media_type=CONTENT_TYPE)
