"""``HEAD`` on every ``GET`` route: answered as ``GET`` is, without the body.

Litestar routes a method only to the handlers that declare it, so a ``HEAD`` would be
405 everywhere; clients use it to ask whether a server runs (Ollama's own client pings
``HEAD /`` and reads any status from 400 on as "not running") or whether a file is
there. :class:`HeadAsGet` wraps the app: the app sees a ``GET`` (the same status and
headers, ``Content-Length`` included), and the body it sends is dropped. The server's
own record of the request stays ``HEAD`` (the scope is copied, not changed), so it
sends no body either. (No ``GET`` route streams without end; the event socket is a
WebSocket.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class HeadAsGet:
    """ASGI middleware: ``HEAD`` requests reach ``app`` as ``GET`` and leave without a
    body (see the module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        ended = False

        async def send_head(message: Message) -> None:
            nonlocal ended
            if message["type"] != "http.response.body":
                await send(message)
            elif not ended:
                ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, send_head)
