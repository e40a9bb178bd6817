"""Who may talk to the service: Host check, CORS allow-list, optional API key.

:class:`SecurityMiddleware` wraps the whole ASGI app, so its checks run before any
routing or body parsing:

1. **Host** must be a loopback name or address (``localhost``, ``*.localhost``,
   ``127.0.0.0/8``, ``::1``), the bind address, or a configured host; anything else
   is 403. This defeats DNS rebinding: a page on ``evil.example`` whose name was
   re-pointed at 127.0.0.1 still sends ``Host: evil.example``.
2. **Origin**, when a browser sends one, must be on the allow-list: the Tauri
   origins, the Tauri dev server and configured ones (``*`` allows all). A refused
   origin gets 403 even for "simple" requests a browser would send without asking,
   so a web page cannot make the engine work for it. Allowed origins are echoed
   exactly in ``Access-Control-Allow-Origin``. The service's own origin on a loopback
   Host (:func:`same_origin`) is allowed too: Chromium sends Origin with the module
   scripts, fetches and WebSocket of the dashboard the service serves at ``/ui``.
3. **Preflight** (``OPTIONS`` with ``Access-Control-Request-Method``) is answered 204
   here and never reaches a handler; ``Access-Control-Allow-Private-Network: true``
   is added when the browser asks for it.
4. **API key**, when configured, is required as ``Authorization: Bearer KEY`` on
   ``/v1`` (401 otherwise); ``/api/health`` stays open.

Every refusal is OpenAI's error JSON.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Iterable
from typing import Any

from service.errors import AUTHENTICATION, PERMISSION, error_body

# Tauri v2 serves its webview from these (macOS/Linux, then Windows over http and
# https); the Tauri dev server listens on 1420.
DEFAULT_ORIGINS: tuple[str, ...] = (
    "tauri://localhost",
    "http://tauri.localhost",
    "https://tauri.localhost",
    "http://localhost:1420",
)
_ALLOW_METHODS = "GET, POST, OPTIONS"
_DEFAULT_ALLOW_HEADERS = "authorization, content-type"
_PREFLIGHT_MAX_AGE_S = "600"


def normalize_origin(origin: str) -> str:
    """Compare origins case-insensitively and without a trailing slash. Never raises,
    whatever the scheme (``tauri://``, ``app://``, anything a user configures)."""
    return origin.strip().rstrip("/").lower()


def host_name(host_header: str) -> str:
    """The name part of a Host header: ``"[::1]:8427"`` -> ``"::1"``,
    ``"localhost:8427"`` -> ``"localhost"``. Lower-case, trailing dot removed."""
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def is_loopback_host(name: str) -> bool:
    """``localhost``, a ``.localhost`` name (RFC 6761: always loopback) or a loopback
    address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is the service's own (``http(s)://<Host header>``) on a
    loopback Host: the dashboard at ``/ui`` calling home. A foreign page cannot send
    that pair: its Origin is its own, and a DNS-rebound name is not a loopback Host."""
    if not host:
        return False
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    return rest.rstrip("/") == host.strip().lower() and is_loopback_host(host_name(host))


class SecurityMiddleware:
    """ASGI middleware applying the checks in the module docstring.

    Args:
        app: the wrapped ASGI app.
        allowed_origins: origins allowed besides :data:`DEFAULT_ORIGINS`; ``"*"``
            allows every origin.
        allowed_hosts: Host names allowed besides loopback ones (e.g. the bind
            address when serving on a LAN).
        api_key: the key required on ``/v1``, or None.
    """

    def __init__(
        self,
        app: Any,
        *,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
        api_key: str | None = None,
    ) -> None:
        self.app = app
        origins = {normalize_origin(o) for o in (*DEFAULT_ORIGINS, *allowed_origins) if o}
        self._any_origin = "*" in origins
        self._origins = frozenset(origins - {"*"})
        self._hosts = frozenset(host_name(h) for h in allowed_hosts if h)
        self._api_key = api_key.encode() if api_key else None

    def origin_allowed(self, origin: str) -> bool:
        return self._any_origin or normalize_origin(origin) in self._origins

    def host_allowed(self, host: str | None) -> bool:
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser, nothing to rebind
        name = host_name(host)
        return is_loopback_host(name) or name in self._hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host")
        if not self.host_allowed(host):
            await _refuse(
                scope, receive, send, 403, f"host {host!r} is not allowed", PERMISSION, "host"
            )
            return
        origin = headers.get("origin")
        if origin is not None and not (self.origin_allowed(origin) or same_origin(origin, host)):
            await _refuse(
                scope, receive, send, 403, f"origin {origin!r} is not allowed", PERMISSION, "origin"
            )
            return
        cors = _cors_headers(origin) if origin is not None else []
        if (
            scope["type"] == "http"
            and scope["method"] == "OPTIONS"
            and origin is not None
            and "access-control-request-method" in headers
        ):
            await _preflight(send, cors, headers)
            return
        if self._api_key is not None and scope["path"].startswith("/v1"):
            if not self._key_ok(headers.get("authorization")):
                await _refuse(
                    scope,
                    receive,
                    send,
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    AUTHENTICATION,
                    "invalid_api_key",
                    extra=[*cors, (b"www-authenticate", b"Bearer")],
                )
                return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _key_ok(self, authorization: str | None) -> bool:
        assert self._api_key is not None
        if not authorization or not authorization.lower().startswith("bearer "):
            return False
        return hmac.compare_digest(authorization[7:].strip().encode(), self._api_key)


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
    ]


async def _preflight(send: Any, cors: list[tuple[bytes, bytes]], headers: dict[str, str]) -> None:
    requested = headers.get("access-control-request-headers", "").strip()
    out = [
        *cors,
        (b"access-control-allow-methods", _ALLOW_METHODS.encode()),
        (b"access-control-allow-headers", (requested or _DEFAULT_ALLOW_HEADERS).encode("latin-1")),
        (b"access-control-max-age", _PREFLIGHT_MAX_AGE_S.encode()),
    ]
    if headers.get("access-control-request-private-network", "").lower() == "true":
        out.append((b"access-control-allow-private-network", b"true"))
    await send({"type": "http.response.start", "status": 204, "headers": out})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(
    scope: dict[str, Any],
    receive: Any,
    send: Any,
    status: int,
    message: str,
    type_: str,
    code: str,
    *,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    if scope["type"] == "websocket":
        await receive()  # the websocket.connect message
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps(error_body(message, type_, None, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
