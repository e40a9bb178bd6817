"""The ASGI app of ``headroom serve``: Litestar routes behind the security middleware.

:func:`create_app` wires one :class:`service.api.services.Services` (settings, supervisor,
tokenizer side) into the routes by dependency injection, registers the OpenAI-shaped
exception handlers, and starts/stops the supervisor with the app's lifespan. The
control plane rides along: the event hub (the supervisor publishes to it, the engine's
events through :mod:`service.supervision.engine_events_to_ui`), ``/api/events``, ``/api/status`` and ``/api/control/*`` behind the local token
(:mod:`service.common.token`), the dashboard at ``/ui``, and the VRAM watcher that publishes
``vram`` events and replans the worker's memory (:mod:`service.vram.watcher`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from litestar import Litestar, Request, Response
from litestar.datastructures import State as AppState
from litestar.di import Provide
from litestar.exceptions import HTTPException

from service.api.anthropic.errors import ANTHROPIC_EXCEPTION_HANDLERS, speaks_anthropic
from service.api.anthropic.routes import AnthropicController
from service.api.ollama.routes import OLLAMA_EXCEPTION_HANDLERS, OllamaController, speaks_ollama
from service.api.openai.routes import OpenAIController
from service.api.openapi import openapi_route
from service.api.services import Services
from service.common.auth import api_key_guard
from service.common.engine_states import State
from service.common.errors import EXCEPTION_HANDLERS, APIError
from service.common.settings import ServeSettings
from service.common.token import load_or_create_token, token_path
from service.control.actions import SupervisorControl
from service.control.health import HealthController
from service.control.metrics import metrics_route, reading_of
from service.control.routes import events_router, unknown_control_route
from service.events.hub import EventHub
from service.events.metrics import ServiceMetrics
from service.events.schemas import HealthEvent
from service.http.dashboard import dashboard_router, root_redirect
from service.http.head import HeadAsGet
from service.http.security import SecurityMiddleware, install_redaction
from service.supervision.config import SupervisorConfig
from service.supervision.engine_events_to_ui import EngineEventsToUI
from service.supervision.report import health_report
from service.supervision.restarts import RestartLimits
from service.supervision.supervisor import Supervisor
from service.vram.simulated import TimelineError
from service.vram.watcher import make_watcher

log = logging.getLogger("headroom.service")


class StartupError(Exception):
    """The app cannot be built (e.g. the local token cannot be written); the message
    says what and where."""


def supervisor_config(settings: ServeSettings) -> SupervisorConfig:
    return SupervisorConfig(
        worker=settings.worker_config(),
        stall_timeout_s=settings.stall_timeout_s,
        start_timeout_s=settings.start_timeout_s,
        restart_limits=RestartLimits(
            max_exits=settings.max_restarts, exit_window_s=settings.restart_window_s
        ),
        memory_settle_s=settings.memory_settle,
        keep_alive_s=settings.keep_alive_s,
        load_on_request=settings.load_on_request,
    )


def _bind_hosts(settings: ServeSettings) -> list[str]:
    """The bind address is an acceptable Host unless it is a wildcard."""
    try:
        if ipaddress.ip_address(settings.host).is_unspecified:
            return []
    except ValueError:
        pass
    return [settings.host]


def _http_error_by_surface(request: Request, exc: HTTPException) -> Response[Any]:
    """An HTTP error no route's own handlers saw (an unknown path, a wrong method) in the
    shape of the API the path belongs to: Ollama's under its ``/api`` routes, Anthropic's
    under ``/v1/messages``, else OpenAI's. A path under ``/api/control`` that names no
    control route is the control API's 404, naming the routes it has."""
    path = request.url.path
    if exc.status_code == 404 and (unknown := unknown_control_route(path, request.method)) is not None:
        return EXCEPTION_HANDLERS[APIError](request, unknown)
    surface = EXCEPTION_HANDLERS
    if speaks_ollama(path, exc.status_code):
        surface = OLLAMA_EXCEPTION_HANDLERS
    elif speaks_anthropic(path):
        surface = ANTHROPIC_EXCEPTION_HANDLERS
    return surface[HTTPException](request, exc)


def create_app(
    settings: ServeSettings,
    *,
    on_start_failure: Callable[[str], None] | None = None,
) -> tuple[Any, Services]:
    """Build the app.

    Args:
        settings: resolved settings.
        on_start_failure: called with the reason when the *first* worker fails to
            load (model missing, unsupported...): the CLI stops the server then, so a
            start-up failure is an exit, not a server answering 503 forever.

    Returns:
        ``(asgi_app, services)``.

    Raises:
        StartupError: the local token file cannot be read or created, or the
            ``--vram-timeline`` file cannot be used.
    """
    try:
        token = load_or_create_token()
    except OSError as exc:
        raise StartupError(
            f"cannot read or create the local token {token_path()}: {exc}; set "
            "HEADROOM_CONFIG_DIR to a folder you can write"
        ) from None
    hub = EventHub()
    supervisor = Supervisor(supervisor_config(settings))
    supervisor.events = hub
    services = Services(settings=settings, supervisor=supervisor)
    to_ui = EngineEventsToUI(hub, supervisor)
    services.metrics = ServiceMetrics(lambda: reading_of(services, to_ui.counts))
    supervisor.on_ready = services.prepare
    supervisor.requests_waiting = lambda: services.admission.waiting > 0
    supervisor.on_model_folder = services.prefetch
    supervisor.on_engine_event = to_ui.record_engine_event
    supervisor.on_stats = to_ui.publish_counters
    try:
        watcher = make_watcher(settings, supervisor, hub)
    except TimelineError as exc:
        raise StartupError(str(exc)) from None
    supervisor.vram_source = watcher.source
    control = SupervisorControl(supervisor, watcher, command_timeout_s=settings.stall_timeout_s)
    watch_tasks: list[asyncio.Task] = []

    async def refresh() -> None:
        """Before a /api/status snapshot: the engine's counters read now (the heartbeat
        handler publishes them)."""
        await supervisor.link.fresh_stats()
        to_ui.publish_counters()

    async def start() -> None:
        hub.attach_loop()
        hub.publish(HealthEvent.from_report(health_report(supervisor)))
        await supervisor.start()
        watch_tasks.append(asyncio.create_task(watcher.run(), name="vram-watcher"))
        if on_start_failure is not None:
            watch_tasks.append(asyncio.create_task(_watch_first_start()))

    async def _watch_first_start() -> None:
        assert supervisor.first_start_done is not None
        await supervisor.first_start_done.wait()
        if supervisor.state is State.FAILED and on_start_failure is not None:
            on_start_failure(supervisor.failure_reason or "the engine failed to start")

    async def stop() -> None:
        for task in watch_tasks:
            task.cancel()
        await asyncio.gather(*watch_tasks, return_exceptions=True)
        await supervisor.stop()
        watcher.source.close()
        hub.close()
        if services.text is not None:
            services.text.close()

    # Whatever path spelling the router accepts for a /v1 route, its guard runs. Without
    # --api-key there is nothing to check, so no guard stands in the request's path.
    openai_routes = type(
        "GuardedOpenAIController",
        (OpenAIController,),
        {"guards": [api_key_guard(settings.api_key)] if settings.api_key else []},
    )
    anthropic_routes = type(
        "GuardedAnthropicController",
        (AnthropicController,),
        {"guards": [api_key_guard(settings.api_key, "x-api-key")] if settings.api_key else []},
    )
    ollama_routes = type(
        "GuardedOllamaController",
        (OllamaController,),
        {"guards": [api_key_guard(settings.api_key)]},
    )
    install_redaction(lambda: (settings.api_key or "", token))
    app = Litestar(
        route_handlers=[
            openai_routes,
            anthropic_routes,
            ollama_routes,
            HealthController,
            # /api/status stays open (as /api/health) for curl and scripts; the control
            # routes and the event socket need the token.
            events_router(
                hub,
                control,
                token=token,
                allowed_origins=settings.cors_origin,
                before_status=refresh,
                status_requires_token=False,
            ),
            dashboard_router(),
            root_redirect,
            openapi_route,
            metrics_route,
        ],
        dependencies={"svc": Provide(lambda: services, sync_to_thread=False)},
        exception_handlers={**EXCEPTION_HANDLERS, HTTPException: _http_error_by_surface},
        on_startup=[start],
        on_shutdown=[stop],
        openapi_config=None,
        logging_config=None,
        request_max_body_size=settings.max_body_size,
        state=AppState({"metrics": services.metrics, "body_timeout_s": settings.body_timeout}),
    )
    secured = SecurityMiddleware(
        HeadAsGet(app),
        allowed_origins=settings.cors_origin,
        allowed_hosts=[*_bind_hosts(settings), *settings.allowed_host],
        max_header_bytes=settings.max_header_size,
    )
    return secured, services
