"""The ``/api/events`` WebSocket: who may open it, and one connection from the snapshot
to its close.

**The token** (:mod:`service.common.token`) is sent as ``Authorization: Bearer <token>``. A
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
import logging
from collections.abc import Callable, Iterable
from typing import Any

from litestar import WebSocket

from service.common.auth import bearer_token, secret_equal
from service.common.errors import PERMISSION, APIError
from service.common.origins import same_origin
from service.events.control_schemas import SUBPROTOCOL_PREFIX
from service.events.hub import EventHub
from service.events.schemas import (
    CLOSE_GOING_AWAY,
    CLOSE_ORIGIN_REFUSED,
    CLOSE_UNAUTHORIZED,
    encode,
)
from service.events.subscription import Subscription, SubscriptionClosed

log = logging.getLogger("headroom.events")

# How long a close frame may take to leave before the connection is abandoned.
CLOSE_TIMEOUT_S = 2.0


def subprotocol_token(offered: Iterable[str]) -> str | None:
    """The first offered subprotocol of the form ``headroom.token.<token>``, whole."""
    for proto in offered:
        if proto.startswith(SUBPROTOCOL_PREFIX) and len(proto) > len(SUBPROTOCOL_PREFIX):
            return proto
    return None


class Gate:
    """Who may use the control plane: the local token and the Origin check, for the
    socket and (as guards) for the control routes.

    Args:
        token: returns the local token (read per request, so a rotated token file takes
            effect).
        origin_allowed: the CORS allow-list check of a browser's Origin.
    """

    def __init__(self, token: Callable[[], str], origin_allowed: Callable[[str], bool]) -> None:
        self.token = token
        self.origin_allowed = origin_allowed

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


async def serve_events(socket: WebSocket, hub: EventHub, gate: Gate) -> None:
    """Run one ``/api/events`` connection to its end (see the module docstring): ``gate``
    checks its Origin and token, then ``hub`` feeds it."""
    origin = socket.headers.get("origin")
    if not gate.origin_ok(origin, socket.headers.get("host")):
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
    if not secret_equal(presented, gate.token()):
        await socket.accept(subprotocols=chosen)
        await _close_quietly(socket, CLOSE_UNAUTHORIZED, "a valid token is required")
        return
    try:
        sub = hub.subscribe(_int_param(query.get("last_seq")), query.get("epoch"))
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
