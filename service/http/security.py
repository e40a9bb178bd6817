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
   Host (:func:`service.common.origins.same_origin`) is allowed too: Chromium sends Origin with the module
   scripts, fetches and WebSocket of the dashboard the service serves at ``/ui``.
   Ollama's routes (``/api/chat``, ``/api/generate``...) also take the origins Ollama
   allows by default (:func:`service.common.origins.ollama_default_origin`: a page on
   localhost, an app:// or file:// one...), as Ollama's web clients expect. The 403
   names the fix, ``--cors-origin <origin>``.
3. **Preflight** (``OPTIONS`` with ``Access-Control-Request-Method``) is answered 204
   here and never reaches a handler; ``Access-Control-Allow-Private-Network: true``
   is added when the browser asks for it.
Every refusal is OpenAI's error JSON (Anthropic's under ``/v1/messages``). The rules on names (which origins and hosts pass)
are :mod:`service.common.origins`, shared with the control plane's socket.

**Secrets** are not checked here, on a path prefix, but by the guards of
:mod:`service.common.auth`, after routing.

:class:`RedactSecrets` is a logging filter that takes ``token=...`` query values,
``headroom.token.<...>`` subprotocols, bearer values and the configured secrets out of
every log line (uvicorn logs the path and query of a WebSocket handshake).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from service.api.anthropic.errors import anthropic_error, speaks_anthropic
from service.api.ollama.routes import OLLAMA_ROUTES, speaks_ollama
from service.common.errors import INVALID_REQUEST, PERMISSION, error_body
from service.common.origins import (
    OriginPolicy,
    ollama_default_origin,
    refused_host,
    refused_origin,
    same_origin,
)

_ALLOW_METHODS = "GET, HEAD, POST, OPTIONS"
_DEFAULT_ALLOW_HEADERS = "authorization, content-type"
_PREFLIGHT_MAX_AGE_S = "600"


class SecurityMiddleware(OriginPolicy):
    """ASGI middleware applying the checks in the module docstring, with the allow-lists
    of its :class:`~service.common.origins.OriginPolicy`.

    Args:
        app: the wrapped ASGI app.
        allowed_origins: origins allowed besides
            :data:`~service.common.origins.DEFAULT_ORIGINS`; ``"*"`` allows every origin.
        allowed_hosts: Host names allowed besides loopback ones (e.g. the bind
            address when serving on a LAN).
        max_header_bytes: ``--max-header-size``: a request whose line and headers
            (:func:`header_bytes`) are larger is answered 431 in its API's shape. The
            HTTP parser refuses only past about twice that (it reads 64 KiB at a time
            and checks an incomplete request), with a bare 400; None: no check here.
    """

    def __init__(
        self,
        app: Any,
        *,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
        max_header_bytes: int | None = None,
    ) -> None:
        super().__init__(allowed_origins=allowed_origins, allowed_hosts=allowed_hosts)
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self.max_header_bytes is not None and (size := header_bytes(scope)) > self.max_header_bytes:
            await _refuse(
                scope, receive, send, 431,
                f"the request line and headers take {size} bytes, more than --max-header-size "
                f"({self.max_header_bytes} bytes)",
                INVALID_REQUEST, "request_header_fields_too_large",
            )
            return
        headers = _headers(scope)
        host = headers.get("host")
        if not self.host_allowed(host):
            await _refuse(
                scope, receive, send, 403, refused_host(host), PERMISSION, "host"
            )
            return
        origin = headers.get("origin")
        if origin is not None and not (
            self.origin_allowed(origin)
            or same_origin(origin, host)
            or (_ollama_route(scope.get("path", "")) and ollama_default_origin(origin))
        ):
            await _refuse(scope, receive, send, 403, refused_origin(origin), PERMISSION, "origin")
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
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _ollama_route(path: str) -> bool:
    """Whether ``path`` is one of Ollama's routes itself (``/api/chat``...), not a path
    under one nor headroom's own ``/api`` routes."""
    name = path.removeprefix("/api/").rstrip("/")
    return path.startswith("/api/") and name in OLLAMA_ROUTES


def header_bytes(scope: dict[str, Any]) -> int:
    """Bytes of a request's line and headers as sent: ``METHOD PATH?QUERY HTTP/1.1``,
    then ``name: value`` a line, each line with its CRLF."""
    line = len(scope.get("method", "GET")) + len(scope.get("raw_path") or scope.get("path", "").encode())
    query = scope.get("query_string", b"")
    line += (len(query) + 1 if query else 0) + len(" HTTP/1.1\r\n") + 1
    return line + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


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
) -> None:
    if scope["type"] == "websocket":
        await receive()  # the websocket.connect message
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    path = scope.get("path", "")
    if speaks_anthropic(path):
        status, answer = anthropic_error(status, message)
        body = msgspec.json.encode(answer)
    elif speaks_ollama(path, status):
        body = msgspec.json.encode({"error": message})
    else:
        body = json.dumps(error_body(message, type_, None, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- secrets out of logs ---------------------------------------------------------------------

REDACTED = "<redacted>"
_SECRET_PATTERNS = (
    # ?token=..., &token=..., access_token=..., api_key=... in a path or query
    re.compile(r"(?i)((?:^|[?&;\s/])(?:[a-z_]*token|api[_-]?key|key)=)[^&\s\"'#]+"),
    re.compile(r"(headroom\.token\.)[A-Za-z0-9_\-]+"),
    re.compile(r"(?i)(bearer\s+)[^\s,\"']+"),
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with secrets replaced by ``<redacted>``: query values of ``token=``,
    ``*_token=``, ``api_key=``, ``key=``; ``headroom.token.<token>`` subprotocols;
    ``Bearer <value>``; and each string of ``secrets`` wherever it appears."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    return text


class RedactSecrets(logging.Filter):
    """A logging filter applying :func:`redact` to each record's final message (its
    arguments merged in), so no handler it is attached to ever writes a secret."""

    def __init__(self, secrets: Callable[[], Iterable[str]] = tuple) -> None:
        super().__init__()
        self._secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error report
            return True
        clean = redact(message, self._secrets())
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_redaction(secrets: Callable[[], Iterable[str]] = tuple) -> RedactSecrets:
    """Attach one :class:`RedactSecrets` to every handler of the root logger and to the
    loggers uvicorn writes the request line of a WebSocket or an HTTP request to (a
    filter on a handler sees records propagated from every logger). Idempotent per
    handler: an older RedactSecrets is replaced."""
    flt = RedactSecrets(secrets)
    handlers = list(logging.getLogger().handlers)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        handlers += logging.getLogger(name).handlers
    for handler in handlers:
        for old in [f for f in handler.filters if isinstance(f, RedactSecrets)]:
            handler.removeFilter(old)
        handler.addFilter(flt)
    for name in ("uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RedactSecrets)]:
            logger.removeFilter(old)
        logger.addFilter(flt)
    return flt
