"""The ASGI app of ``headroom serve``: Litestar routes behind the security middleware.

:func:`create_app` wires one :class:`service.state.Services` (settings, supervisor,
tokenizer side) into the routes by dependency injection, registers the OpenAI-shaped
exception handlers, and starts/stops the supervisor with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from litestar import Litestar
from litestar.di import Provide

from service.errors import EXCEPTION_HANDLERS
from service.health import HealthController
from service.openai_api import OpenAIController
from service.security import SecurityMiddleware
from service.settings import ServeSettings
from service.state import Services
from service.supervisor import State, Supervisor, SupervisorConfig

log = logging.getLogger("headroom.service")


def supervisor_config(settings: ServeSettings) -> SupervisorConfig:
    return SupervisorConfig(
        worker=settings.worker_config(),
        stall_timeout_s=settings.stall_timeout_s,
        start_timeout_s=settings.start_timeout_s,
        max_exits=settings.max_restarts,
        exit_window_s=settings.restart_window_s,
    )


def _bind_hosts(settings: ServeSettings) -> list[str]:
    """The bind address is an acceptable Host unless it is a wildcard."""
    try:
        if ipaddress.ip_address(settings.host).is_unspecified:
            return []
    except ValueError:
        pass
    return [settings.host]


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
    """
    supervisor = Supervisor(supervisor_config(settings))
    services = Services(settings=settings, supervisor=supervisor)
    supervisor.on_ready = services.prepare
    supervisor.on_engine_event = services.record_engine_event
    watch_tasks: list[asyncio.Task] = []

    async def start() -> None:
        await supervisor.start()
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
        await supervisor.stop()
        if services.text is not None:
            services.text.close()

    app = Litestar(
        route_handlers=[OpenAIController, HealthController],
        dependencies={"svc": Provide(lambda: services, sync_to_thread=False)},
        exception_handlers=EXCEPTION_HANDLERS,
        on_startup=[start],
        on_shutdown=[stop],
        openapi_config=None,
        logging_config=None,
    )
    secured = SecurityMiddleware(
        app,
        allowed_origins=settings.cors_origin,
        allowed_hosts=[*_bind_hosts(settings), *settings.allowed_host],
        api_key=settings.api_key,
    )
    return secured, services
