"""The control plane's routes: ``/api/events`` (WebSocket), ``/api/status``, and the
token-protected control actions; plus the dashboard page at ``/ui``.

:func:`events_router` builds a Litestar :class:`~litestar.Router` around an
:class:`service.events.hub.EventHub` and a :class:`ControlTarget` (what carries the
actions out; the supervisor implements it), so the routes know nothing of workers.

Routes (under ``path``, default ``/api``):

- ``GET /status``: the hub's :class:`service.events.hub.Snapshot` as JSON (open by
  default, like ``/api/health``; ``status_requires_token=True`` protects it).
- ``POST /control/restart``: restart the worker. No body. 202.
- ``POST /control/pause``: game mode: stop the worker and give its memory back (state
  ``paused``; requests get 503 + Retry-After, or with ``--load-on-request`` wake it).
  No body. 202.
- ``POST /control/resume``: load the worker again after a pause. No body. 202.
- ``POST /control/reserve``: ``{"reserve": "auto" | bytes | "1.5GiB"}``. 202.
- ``POST /control/cache``: ``{"kv_cache": bytes | "6GiB" | null, "expert_cache":
  bytes | "1GiB" | null, "clear_prefix_cache": bool}``; a null size means "back to the
  plan's size"; at least one of the three. 202.
- ``WS /events``: see below.

Every control route answers :class:`ControlResponse`, or the service's error shape
(``{"error": {...}}``): 401 without the token, 403 for an Origin not on the list, 400
for a bad body, and whatever :class:`service.api.errors.APIError` the target raises (e.g.
409 or 503); a target's ValueError is a 400, NotImplementedError a 501.

**The token** (:mod:`service.events.token`) is sent as ``Authorization: Bearer <token>``. A
browser cannot set headers on a WebSocket, so the socket also takes it as the
subprotocol ``headroom.token.<token>`` (the server echoes it, as the WebSocket
handshake requires) or as ``?token=<token>`` (redacted in logs,
:class:`service.http.security.RedactSecrets`). Tokens are compared in constant time. On the
control routes (and ``/status`` when protected) the Origin check and the token are
Litestar guards (:class:`service.http.security.BearerGuard`), so they run for whatever
spelling of the path the router accepted.

**Origins.** A browser's Origin must be on the same allow-list as CORS, or be the
service's own origin on a loopback Host (the dashboard at ``/ui``); else the control
routes answer 403 and the socket refuses the handshake.

**The socket.** The Origin (when sent) must pass that check, else
the handshake is refused (close code :data:`~service.events.hub.CLOSE_ORIGIN_REFUSED`,
4003, before accepting: a browser sees a failed handshake). A missing or wrong token
is accepted and closed at once with :data:`~service.events.hub.CLOSE_UNAUTHORIZED` (4001),
so a client can tell it apart from a network error and stop retrying. Then:

1. ``?last_seq=N&epoch=E`` resumes: when the events after ``N`` of hub ``E`` are
   still buffered, they come first, in order, and no snapshot; otherwise (or without
   ``last_seq``) the first frame is ``{"type": "snapshot", ...}``.
2. Then every event as one JSON text frame, in ``seq`` order.
3. A client that does not keep up (its queue of
   :data:`~service.events.hub.DEFAULT_QUEUE_SIZE` events overflows) is closed with
   :data:`~service.events.hub.CLOSE_TOO_SLOW` (4008); at shutdown, 1001. Frames the
   client sends are read and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, Protocol

import msgspec
from litestar import Request, Router, WebSocket, get, post, websocket
from litestar.datastructures import State

from service.api.errors import (
    EXCEPTION_HANDLERS,
    PERMISSION,
    APIError,
    decode_body,
    invalid,
)
from service.cli.settings import parse_size
from service.events.hub import EventHub, Subscription, SubscriptionClosed
from service.events.schemas import (
    CLOSE_GOING_AWAY,
    CLOSE_ORIGIN_REFUSED,
    CLOSE_UNAUTHORIZED,
    Snapshot,
    encode,
)
from service.http.auth import bearer_token, secret_equal, token_guard
from service.http.security import SecurityMiddleware, same_origin

log = logging.getLogger("headroom.events")

SUBPROTOCOL_PREFIX = "headroom.token."
# How long a close frame may take to leave before the connection is abandoned.
CLOSE_TIMEOUT_S = 2.0


# -- control: the target and the bodies --------------------------------------------------------


class ControlTarget(Protocol):
    """What carries out the control actions (:class:`service.events.control.SupervisorControl`).

    Each method may be sync or async and returns a message for people (or None).
    Raise :class:`service.api.errors.APIError` to refuse with a status (e.g. 409 while
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


class ReserveRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /api/control/reserve``: ``reserve`` is ``"auto"``, a number of
    bytes, or a size as text (``"1.5GiB"``, ``"512MiB"``)."""

    reserve: int | str


class CacheRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /api/control/cache``. ``kv_cache``: the KV pool's size (bytes or
    text such as ``"6GiB"``; null: back to the plan's size; absent: unchanged).
    ``clear_prefix_cache``: evict the prefix cache's unused pages (done first).
    ``expert_cache``: the GPU expert cache's size, for routed experts in host memory
    (``--cpu-experts``; bytes or text, whole slots; null: the plan's size; absent:
    unchanged); done before ``kv_cache``."""

    kv_cache: int | str | None | msgspec.UnsetType = msgspec.UNSET
    expert_cache: int | str | None | msgspec.UnsetType = msgspec.UNSET
    clear_prefix_cache: bool = False


class ControlResponse(msgspec.Struct, kw_only=True):
    """What a control route answers: ``action`` done (``restart``, ``pause``,
    ``resume``, ``reserve``, ``cache``), and the target's ``message``."""

    ok: bool
    action: str
    message: str | None = None


# -- auth ----------------------------------------------------------------------------------------


def subprotocol_token(offered: Iterable[str]) -> str | None:
    """The first offered subprotocol of the form ``headroom.token.<token>``, whole."""
    for proto in offered:
        if proto.startswith(SUBPROTOCOL_PREFIX) and len(proto) > len(SUBPROTOCOL_PREFIX):
            return proto
    return None


def default_origin_check(allowed_origins: Iterable[str] = ()) -> Callable[[str], bool]:
    """The CORS allow-list check of :class:`service.http.security.SecurityMiddleware` (the
    Tauri origins, the dev server, ``allowed_origins``; ``"*"`` allows all), reused so
    the socket and CORS can never disagree."""
    return SecurityMiddleware(None, allowed_origins=allowed_origins).origin_allowed


def _parse_size_field(value: int | str, param: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise invalid(str(exc), param) from None


async def _call(fn: Callable[..., Any], *args: Any) -> str | None:
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
        raise invalid(str(exc)) from None
    return None if result is None else str(result)


# -- the socket ----------------------------------------------------------------------------------


class _Context:
    def __init__(
        self,
        hub: EventHub,
        control: ControlTarget,
        token: Callable[[], str],
        origin_allowed: Callable[[str], bool],
        status_requires_token: bool,
        before_status: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.hub = hub
        self.control = control
        self.token = token
        self.origin_allowed = origin_allowed
        self.status_requires_token = status_requires_token
        self.before_status = before_status

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        """No Origin (not a browser), one on the allow-list, or the service's own."""
        return origin is None or self.origin_allowed(origin) or same_origin(origin, host)

    def check_origin(self, connection: Any, _handler: Any = None) -> None:
        """A guard: the Origin of a control request.

        Raises:
            APIError: 403 for a refused Origin.
        """
        origin = connection.headers.get("origin")
        if not self.origin_ok(origin, connection.headers.get("host")):
            raise APIError(403, f"origin {origin!r} is not allowed", type=PERMISSION, code="origin")


async def _close_quietly(socket: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(socket.close(code, reason[:120]), CLOSE_TIMEOUT_S)


async def _refuse_before_accept(socket: WebSocket, code: int, reason: str) -> None:
    """Close during the handshake: the server answers 403 and a browser sees a failed
    connection (ASGI: ``websocket.close`` before ``websocket.accept``)."""
    with contextlib.suppress(Exception):
        await socket.receive()  # websocket.connect
        await socket.close(code, reason[:120])


def _int_param(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def serve_events(socket: WebSocket, ctx: _Context) -> None:
    """Run one ``/api/events`` connection to its end (see the module docstring)."""
    origin = socket.headers.get("origin")
    if not ctx.origin_ok(origin, socket.headers.get("host")):
        log.warning("refused an event socket from origin %r", origin)
        await _refuse_before_accept(
            socket, CLOSE_ORIGIN_REFUSED, f"origin {origin!r} is not allowed"
        )
        return
    offered = list(socket.scope.get("subprotocols") or [])
    chosen = subprotocol_token(offered)
    query = socket.query_params
    presented = (
        (chosen[len(SUBPROTOCOL_PREFIX) :] if chosen else None)
        or bearer_token(socket.headers.get("authorization"))
        or query.get("token")
    )
    if not secret_equal(presented, ctx.token()):
        await socket.accept(subprotocols=chosen)
        await _close_quietly(socket, CLOSE_UNAUTHORIZED, "a valid token is required")
        return
    try:
        sub = ctx.hub.subscribe(_int_param(query.get("last_seq")), query.get("epoch"))
    except RuntimeError:
        await socket.accept(subprotocols=chosen)
        await _close_quietly(socket, CLOSE_GOING_AWAY, "the service is stopping")
        return
    try:
        await socket.accept(subprotocols=chosen)
        await _pump_until_done(socket, sub)
    finally:
        sub.close()


async def _pump_until_done(socket: WebSocket, sub: Subscription) -> None:
    async def pump() -> None:
        if sub.snapshot is not None:
            await socket.send_text(encode(sub.snapshot))
        for item in sub.missed:
            await socket.send_text(item.text)
        sub.missed = []
        while True:
            item = await sub.get()
            await socket.send_text(item.text)

    async def drain() -> None:
        while True:
            message = await socket.receive()
            if message["type"] == "websocket.disconnect":
                return

    tasks = [
        asyncio.ensure_future(pump()),
        asyncio.ensure_future(drain()),
        asyncio.ensure_future(sub.closed_event.wait()),
    ]
    sender, receiver, _ = tasks
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if receiver.done() and not receiver.cancelled() and receiver.exception() is None:
        return  # the client left
    if sub.closed:
        await _close_quietly(socket, sub.close_code or 1000, sub.close_reason)
        return
    error = sender.exception() if sender.done() and not sender.cancelled() else None
    if error is not None and not isinstance(error, SubscriptionClosed):
        log.debug("event socket ended: %r", error)
    await _close_quietly(socket, 1011, "internal error")


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
    ctx = _Context(
        hub,
        control,
        get_token,  # type: ignore[arg-type]
        origin_allowed or default_origin_check(allowed_origins),
        status_requires_token,
        before_status,
    )

    @websocket("/events")
    async def events_socket(socket: WebSocket) -> None:
        await serve_events(socket, ctx)

    async def status() -> Snapshot:
        if ctx.before_status is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ctx.before_status(), 3.0)
        return ctx.hub.snapshot()

    # Authentication sits where routing decides: the guards run for whatever path
    # spelling reached a control handler.
    # Plain functions, not bound methods: Litestar deep-copies a Router it registers.
    def origin_guard(connection: Any, _handler: Any) -> None:
        ctx.check_origin(connection)

    guards = [origin_guard, token_guard(ctx.token)]

    @post("/control/restart", status_code=202, guards=guards)
    async def control_restart() -> ControlResponse:
        message = await _call(ctx.control.restart)
        return ControlResponse(ok=True, action="restart", message=message)

    @post("/control/pause", status_code=202, guards=guards)
    async def control_pause() -> ControlResponse:
        message = await _call(ctx.control.pause)
        return ControlResponse(ok=True, action="pause", message=message)

    @post("/control/resume", status_code=202, guards=guards)
    async def control_resume() -> ControlResponse:
        message = await _call(ctx.control.resume)
        return ControlResponse(ok=True, action="resume", message=message)

    @post("/control/reserve", status_code=202, guards=guards)
    async def control_reserve(request: Request[Any, Any, State]) -> ControlResponse:
        body = decode_body(await request.body(), ReserveRequest)
        value: int | Literal["auto"]
        if isinstance(body.reserve, str) and body.reserve.strip().lower() == "auto":
            value = "auto"
        else:
            value = _parse_size_field(body.reserve, "reserve")
        message = await _call(ctx.control.set_reserve, value)
        return ControlResponse(ok=True, action="reserve", message=message)

    @post("/control/cache", status_code=202, guards=guards)
    async def control_cache(request: Request[Any, Any, State]) -> ControlResponse:
        body = decode_body(await request.body(), CacheRequest)
        if body.kv_cache is msgspec.UNSET and body.expert_cache is msgspec.UNSET and not body.clear_prefix_cache:
            raise invalid(
                "nothing to do: send 'kv_cache' or 'expert_cache' (bytes, a size such as "
                "\"6GiB\", or null for the plan's size) and/or 'clear_prefix_cache': true"
            )
        messages = []
        if body.clear_prefix_cache:
            messages.append(await _call(ctx.control.clear_prefix_cache))
        if body.expert_cache is not msgspec.UNSET:
            size = None if body.expert_cache is None else _parse_size_field(body.expert_cache, "expert_cache")
            messages.append(await _call(ctx.control.set_expert_cache, size))
        if body.kv_cache is not msgspec.UNSET:
            size = None if body.kv_cache is None else _parse_size_field(body.kv_cache, "kv_cache")
            messages.append(await _call(ctx.control.set_kv_cache, size))
        text = "; ".join(m for m in messages if m) or None
        return ControlResponse(ok=True, action="cache", message=text)

    handlers: list[Any] = [
        events_socket,
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
