"""The control plane's routes: ``/api/events`` (WebSocket), ``/api/status``, and the
token-protected control actions.

:func:`events_router` builds a Litestar :class:`~litestar.Router` around an
:class:`service.events.hub.EventHub` and a :class:`ControlTarget` (what carries the
actions out; the supervisor implements it), so the routes know nothing of workers.

Routes (under ``path``, default ``/api``):

- ``GET /status``: the hub's :class:`service.events.hub.Snapshot` as JSON (open by
  default, like ``/api/health``; ``status_requires_token=True`` protects it).
- ``POST /control/restart``: restart the worker. No body (or ``{}``; anything else is a
  400). 202 (409 while ``paused``: a resume ends a pause).
- ``POST /control/pause``: game mode: stop the worker and give its memory back (state
  ``paused``; requests get 503 + Retry-After, or with ``--load-on-request`` wake it).
  No body (or ``{}``). 202.
- ``POST /control/resume``: load the worker again after a pause. No body (or ``{}``). 202.
- ``POST /control/reserve``: ``{"reserve": "auto" | bytes | "1.5GiB"}``. 202.
- ``POST /control/cache``: ``{"kv_cache": bytes | "6GiB" | null, "expert_cache":
  bytes | "1GiB" | null, "cpu_layers": int | null, "clear_prefix_cache": bool}``; a null
  size means "back to the plan's size" (null layers: the start's split); at least one of
  the four. 202.
- ``WS /events``: see below; a plain ``GET /events`` (no WebSocket upgrade) is 426
  Upgrade Required with ``Upgrade: websocket``.

The target runs the actions one at a time (:func:`service.control.actions.one_at_a_time`).
Every control route answers :class:`ControlResponse`, or the service's error shape
(``{"error": {...}}``): 401 without the token, 403 for an Origin not on the list, 400
for a bad body, and whatever :class:`service.common.errors.APIError` the target raises (e.g.
409 or 503); a target's ValueError is a 400, NotImplementedError a 501. The bodies are
:mod:`service.events.control_schemas`.

On the control routes (and ``/status`` when protected) the Origin check and the token
are Litestar guards (:class:`service.common.auth.BearerGuard`), so they run for
whatever spelling of the path the router accepted. The socket, its token and Origin
rules and its frames are :mod:`service.control.socket`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, Protocol

import msgspec
from litestar import Request, Router, WebSocket, get, post, websocket
from litestar.datastructures import State

from engine.common.clip import clip
from service.common.auth import token_guard
from service.common.errors import (
    EXCEPTION_HANDLERS,
    INVALID_VALUE,
    NOT_FOUND,
    APIError,
    decode_body,
    invalid,
)
from service.common.origins import OriginPolicy
from service.common.settings import parse_size
from service.control.socket import Gate, serve_events
from service.events.control_schemas import CacheRequest, ControlResponse, NoBody, ReserveRequest
from service.events.hub import EventHub
from service.events.schemas import Snapshot

# The control actions, each ``POST {path}/control/<action>``: what a path under
# ``/api/control`` that names none of them is answered with (:func:`unknown_control_route`).
CONTROL_ACTIONS: tuple[str, ...] = ("restart", "pause", "resume", "reserve", "cache")


def unknown_control_route(path: str, method: str, prefix: str = "/api") -> APIError | None:
    """The 404, in the control API's error shape (``{"error": {"message", "type",
    "param", "code"}}``, code ``unknown_control_route``), for ``method path`` under
    ``{prefix}/control`` that no control route serves, naming the routes that exist;
    None for a path outside ``{prefix}/control``."""
    base = f"{prefix}/control"
    if path != base and not path.startswith(base + "/"):
        return None
    routes = ", ".join(f"{base}/{action}" for action in CONTROL_ACTIONS)
    return APIError(
        404,
        f"no control route {method} {clip(path)}: the control routes are POST {routes} "
        "(with the local token, `headroom token`)",
        type=NOT_FOUND,
        code="unknown_control_route",
    )


# -- control: the target --------------------------------------------------------------------------


class ControlTarget(Protocol):
    """What carries out the control actions (:class:`service.control.actions.SupervisorControl`).

    Each method may be sync or async and returns a message for people (or None).
    Raise :class:`service.common.errors.APIError` to refuse with a status (e.g. 409 while
    restarting), ValueError for a value it cannot take (400), NotImplementedError
    when it cannot do that at all (501).
    """

    def restart(self) -> Awaitable[str | None] | str | None:
        """Kill the worker (if any) and start a new one, also from ``failed``."""
        ...

    def pause(self) -> Awaitable[str | None] | str | None:
        """Stop the worker and give its memory back (``paused``)."""
        ...

    def resume(self) -> Awaitable[str | None] | str | None:
        """Load the worker again after a pause."""
        ...

    def set_reserve(self, reserve: int | Literal["auto"]) -> Awaitable[str | None] | str | None:
        """Keep ``reserve`` bytes free for the desktop (``"auto"``: the default)."""
        ...

    def set_kv_cache(self, kv_cache_bytes: int | None) -> Awaitable[str | None] | str | None:
        """Resize the KV pool to ``kv_cache_bytes`` (None: back to the plan's size)."""
        ...

    def clear_prefix_cache(self) -> Awaitable[str | None] | str | None:
        """Evict every prefix-cache page no running request holds."""
        ...

    def set_expert_cache(self, expert_cache_bytes: int | None) -> Awaitable[str | None] | str | None:
        """Resize the GPU expert cache to ``expert_cache_bytes`` (None: the plan's size)."""
        ...

    def set_cpu_layers(self, cpu_layers: int | None) -> Awaitable[str | None] | str | None:
        """Run the last ``cpu_layers`` decoder layers on the CPU (None: the start's split)."""
        ...


def default_origin_check(allowed_origins: Iterable[str] = ()) -> Callable[[str], bool]:
    """The CORS allow-list check (:class:`service.common.origins.OriginPolicy`: the Tauri
    origins, the dev server, ``allowed_origins``; ``"*"`` allows all), the one
    :class:`service.http.security.SecurityMiddleware` applies, so the socket and CORS can
    never disagree."""
    return OriginPolicy(allowed_origins=allowed_origins).origin_allowed


def _parse_size_field(value: int | float | str, param: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise invalid(str(exc), param) from None


def _no_body(raw: bytes, action: str) -> None:
    """Refuse a body on an action that takes none (:class:`NoBody`): empty or ``{}``
    only, so a field sent for an action that has none is not silently dropped.

    Raises:
        APIError: 400 naming the action and what is wrong with the body.
    """
    if not raw.strip():
        return
    try:
        decode_body(raw, NoBody)
    except APIError as exc:
        raise invalid(f"the control action {action} takes no body (send none, or {{}}): {exc.message}",
                      exc.param, exc.code or INVALID_VALUE) from None


async def _call(fn: Callable[..., Any], *args: Any, param: str | None = None) -> str | None:
    try:
        result = fn(*args)
        if inspect.isawaitable(result):
            result = await result
    except APIError:
        raise
    except NotImplementedError as exc:
        raise APIError(
            501, str(exc) or "this action is not supported", code="not_implemented"
        ) from None
    except ValueError as exc:
        raise invalid(str(exc), param) from None
    return None if result is None else str(result)


# -- the router ----------------------------------------------------------------------------------


def events_router(
    hub: EventHub,
    control: ControlTarget,
    *,
    token: str | Callable[[], str],
    origin_allowed: Callable[[str], bool] | None = None,
    allowed_origins: Iterable[str] = (),
    path: str = "/api",
    status_path: str | None = "/status",
    status_requires_token: bool = False,
    before_status: Callable[[], Awaitable[None]] | None = None,
) -> Router:
    """The control plane's routes as one Router (see the module docstring).

    Args:
        hub: the event hub the socket and ``/status`` read.
        control: carries out the control actions.
        token: the local token, or a function returning it (read per request, so a
            rotated token file takes effect).
        origin_allowed: the Origin check; default :func:`default_origin_check` of
            ``allowed_origins``. Pass the app's ``SecurityMiddleware.origin_allowed``.
        path: the Router's path.
        status_path: where the snapshot is served (None: not at all).
        status_requires_token: whether ``/status`` needs the token.
        before_status: awaited before a ``/status`` snapshot is taken (e.g. to publish
            fresh engine counters first).
    """
    get_token = token if callable(token) else (lambda: token)  # type: ignore[assignment]
    gate = Gate(get_token, origin_allowed or default_origin_check(allowed_origins))  # type: ignore[arg-type]

    @websocket("/events")
    async def events_socket(socket: WebSocket) -> None:
        await serve_events(socket, hub, gate)

    @get("/events", include_in_schema=False)
    async def events_without_upgrade() -> None:
        # A plain GET (a browser tab, curl) learns the route is a WebSocket, not a 405.
        raise APIError(426, "/api/events is a WebSocket: connect with a WebSocket client (Upgrade: websocket)",
                       code="upgrade_required", headers={"Upgrade": "websocket"})

    async def status() -> Snapshot:
        if before_status is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(before_status(), 3.0)
        return hub.snapshot()

    # Authentication sits where routing decides: the guards run for whatever path
    # spelling reached a control handler.
    # Plain functions, not bound methods: Litestar deep-copies a Router it registers.
    def origin_guard(connection: Any, _handler: Any) -> None:
        gate.check_origin(connection)

    guards = [origin_guard, token_guard(gate.token)]

    @post("/control/restart", status_code=202, guards=guards)
    async def control_restart(request: Request[Any, Any, State]) -> ControlResponse:
        _no_body(await request.body(), "restart")
        message = await _call(control.restart)
        return ControlResponse(ok=True, action="restart", message=message)

    @post("/control/pause", status_code=202, guards=guards)
    async def control_pause(request: Request[Any, Any, State]) -> ControlResponse:
        _no_body(await request.body(), "pause")
        message = await _call(control.pause)
        return ControlResponse(ok=True, action="pause", message=message)

    @post("/control/resume", status_code=202, guards=guards)
    async def control_resume(request: Request[Any, Any, State]) -> ControlResponse:
        _no_body(await request.body(), "resume")
        message = await _call(control.resume)
        return ControlResponse(ok=True, action="resume", message=message)

    @post("/control/reserve", status_code=202, guards=guards)
    async def control_reserve(request: Request[Any, Any, State]) -> ControlResponse:
        body = decode_body(await request.body(), ReserveRequest)
        value: int | Literal["auto"]
        if isinstance(body.reserve, str) and body.reserve.strip().lower() == "auto":
            value = "auto"
        else:
            value = _parse_size_field(body.reserve, "reserve")
        message = await _call(control.set_reserve, value, param="reserve")
        return ControlResponse(ok=True, action="reserve", message=message)

    @post("/control/cache", status_code=202, guards=guards)
    async def control_cache(request: Request[Any, Any, State]) -> ControlResponse:
        body = decode_body(await request.body(), CacheRequest)
        if (body.kv_cache is msgspec.UNSET and body.expert_cache is msgspec.UNSET
                and body.cpu_layers is msgspec.UNSET and not body.clear_prefix_cache):
            raise invalid(
                "nothing to do: send 'kv_cache' or 'expert_cache' (bytes, a size such as "
                "\"6GiB\", or null for the plan's size), 'cpu_layers' (a number of decoder layers, "
                "or null for the start's split) and/or 'clear_prefix_cache': true"
            )
        # Every field is read before anything is done, and the prefix cache is cleared
        # last: a refused size leaves the engine as it was.
        experts = (msgspec.UNSET if body.expert_cache is msgspec.UNSET else
                   None if body.expert_cache is None else _parse_size_field(body.expert_cache, "expert_cache"))
        kv = (msgspec.UNSET if body.kv_cache is msgspec.UNSET else
              None if body.kv_cache is None else _parse_size_field(body.kv_cache, "kv_cache"))
        messages = []
        if body.cpu_layers is not msgspec.UNSET:
            messages.append(await _call(control.set_cpu_layers, body.cpu_layers, param="cpu_layers"))
        if experts is not msgspec.UNSET:
            messages.append(await _call(control.set_expert_cache, experts, param="expert_cache"))
        if kv is not msgspec.UNSET:
            messages.append(await _call(control.set_kv_cache, kv, param="kv_cache"))
        if body.clear_prefix_cache:
            messages.append(await _call(control.clear_prefix_cache))
        text = "; ".join(m for m in messages if m) or None
        return ControlResponse(ok=True, action="cache", message=text)

    handlers: list[Any] = [
        events_socket,
        events_without_upgrade,
        control_restart,
        control_pause,
        control_resume,
        control_reserve,
        control_cache,
    ]
    if status_path is not None:
        handlers.append(get(status_path, guards=guards if status_requires_token else None)(status))
    return Router(
        path=path,
        route_handlers=handlers,
        exception_handlers=EXCEPTION_HANDLERS,
    )
