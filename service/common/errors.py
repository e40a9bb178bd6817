"""Every error the HTTP surface returns, in OpenAI's shape, mapped in one place.

Body: ``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``.
:data:`EXCEPTION_HANDLERS` is given to the Litestar app, so an exception raised
anywhere (a route, body decoding, a missing route, a bug) leaves as this shape with
the right status: 400 for a request at fault (with ``param``), 401 for a missing API
key, 403 for a refused Host or Origin, 404 for an unknown route or model, 503 while
the engine is not ready (with Retry-After), 500 only for a bug, never as plain text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from engine.common.clip import clip
from engine.common.errors import RequestRejected
from engine.text.chat import ChatTemplateError
from service.common.engine_states import NotReady, State
from service.common.unserved_routes import unserved_path, unserved_route

log = logging.getLogger("headroom.api")

T = TypeVar("T")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"

CLIENT_GONE = 499  # nginx's code for "client closed request", used in our logs only


class APIError(Exception):
    """An error answered as OpenAI's error object.

    Args:
        status: HTTP status code.
        message: for a person: what is wrong and what to do.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``...).
        param: the request field at fault (``"messages[0].role"``), or None.
        code: a machine-readable code (``"context_length_exceeded"``), or None.
        headers: extra response headers (``Retry-After``).

    Attributes:
        logged: the call's own log line already names this error (the generation
            runner's, :func:`service.api.responses.log_request`), and its metrics took
            it: the handler that answers it adds neither.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.logged = False

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object as a dict."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# The kinds of 400 (``code``) a request at fault gets when no more particular code names it.
INVALID_VALUE = "invalid_value"  # a field's value is out of range or not one served
INVALID_TYPE = "invalid_type"  # a field (or the body) is of the wrong JSON type
MISSING_FIELD = "missing_field"  # a required field is absent
INVALID_JSON = "invalid_json"  # the body is empty or not JSON


def invalid(message: str, param: str | None = None, code: str = INVALID_VALUE) -> APIError:
    """A 400 for a request that cannot be served as sent; ``code`` names the kind
    (:data:`INVALID_VALUE` unless a more particular one is given)."""
    return APIError(400, message, param=param, code=code)


def from_not_ready(exc: NotReady) -> APIError:
    """503 while starting/restarting (with Retry-After) or failed."""
    code = {
        State.STARTING: "engine_starting",
        State.RESTARTING: "engine_restarting",
        State.FAILED: "engine_failed",
        State.STOPPED: "server_shutting_down",
        State.WAITING_FOR_MEMORY: "engine_waiting_for_memory",
        State.WAITING_FOR_GPU: "engine_waiting_for_gpu",
        State.PAUSED: "engine_paused",
        State.IDLE: "engine_idle",
    }.get(exc.state, "engine_unavailable")
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
    return APIError(503, exc.message, type=SERVER_ERROR, code=code, headers=headers)


def from_rejected(exc: RequestRejected) -> APIError:
    """A request the engine refuses to queue (e.g. longer than its KV pool)."""
    return invalid(exc.message, exc.param, exc.code)


# -- request bodies -----------------------------------------------------------------------

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_IN_MAP = "[...]"  # msgspec's step into a map's value, whose key it does not name
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def decode_body(raw: bytes, type_: type[T]) -> T:
    """Decode a JSON request body into ``type_`` (a msgspec struct).

    Raises:
        APIError: 400 for an empty body, invalid JSON (invalid UTF-8, ``NaN``...), a
            JSON value that is not an object, a missing field or a field of the wrong
            type or value; ``param`` names the field (``"messages[0].content"``) when
            there is one; inside a map (``logit_bias``, a message, a schema), whose key
            msgspec does not name, the field the map is (``"logit_bias"``, the message
            saying the value is inside it). Anything else the decoder cannot take
            (nesting deeper than its recursion limit, a number too large for memory) is
            a 400 too: a body is the client's to fix, never a 500.
    """
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, which RFC 8259 lets a reader ignore
    if not raw.strip():
        raise invalid("the request body is empty; send a JSON object", code=INVALID_JSON)
    try:
        return msgspec.json.decode(raw, type=type_)
    except RecursionError:
        raise invalid(
            "the request body is nested too deeply to decode; flatten the JSON", code="too_deep"
        ) from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = None
        match = _PATH.search(text)
        inside = False
        if match:
            param = match.group("path") or None
            text = text[: match.start()]
        if param and _IN_MAP in param:  # msgspec's "[...]": a key it does not name
            param, inside = param.split(_IN_MAP, 1)[0] or None, True
        if text == "Number out of range":  # 1e400 and the like: no float holds it
            text += " (larger than a 64-bit float holds, about 1.8e308)"
        missing = _MISSING.search(text)
        if missing:
            param = f"{param}.{missing.group('field')}" if param else missing.group("field")
        if text.startswith("Expected `object`") and param is None:
            text = f"the request body must be a JSON object: {text}"
        code = MISSING_FIELD if missing else _validation_kind(text)
        # The field in the message too: clients show the message, not always ``param``
        # (and Ollama's error shape has no ``param``).
        where = f" {param}{' (a value inside it)' if inside else ''}:" if param else ""
        raise invalid(f"invalid request:{where} {text}", param, code) from None
    except msgspec.DecodeError as exc:
        repaired = _lone_surrogates_replaced(raw) if _SURROGATE.search(raw) else None
        if repaired is not None:
            return decode_body(repaired, type_)
        hint = ""
        if raw.lstrip().startswith(b"--"):
            hint = " (it looks like a multipart form: send the JSON object itself as the body, Content-Type: application/json)"
        raise invalid(
            f"the request body is not valid JSON: {_where(str(exc), raw)}{hint}", code=INVALID_JSON
        ) from None
    except (ValueError, MemoryError, OverflowError) as exc:
        raise invalid(f"the request body cannot be decoded: {type(exc).__name__}") from None


# A UTF-16 surrogate's escape: msgspec refuses one left unpaired (and at a string's end
# calls the body truncated).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogates_replaced(raw: bytes) -> bytes | None:
    """``raw`` with each unpaired UTF-16 surrogate escape (``"\\ud83d"`` alone: text cut in
    the middle of an emoji by a client that counts UTF-16 units) made U+FFFD, as a JSON
    reader that decodes to UTF-8 must; None where ``raw`` is not JSON for another reason."""
    import json

    try:
        value = json.loads(raw)  # the standard library keeps lone surrogates in its strings
    except (ValueError, RecursionError):
        return None

    def fix(v: Any) -> Any:
        if isinstance(v, str):
            return v.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {fix(k): fix(x) for k, x in v.items()}
        return v

    try:
        return json.dumps(fix(value), ensure_ascii=False).encode()
    except (ValueError, RecursionError):
        return None


# msgspec's "Expected `int`, got `str`" (a type) against "Expected `int` >= 1" (a range).
_WRONG_TYPE = re.compile(r"Expected `[^`]+`, got `[^`]+`")


def _validation_kind(text: str) -> str:
    """:data:`INVALID_TYPE` for msgspec's wrong-type message, else :data:`INVALID_VALUE`."""
    return INVALID_TYPE if _WRONG_TYPE.search(text) else INVALID_VALUE


_AT_BYTE = re.compile(r"\s*\(byte (?P<at>\d+)\)$")


def _where(message: str, raw: bytes) -> str:
    """msgspec's decode error with its byte offset as a line and column and the text
    there (``invalid character at line 3, column 7, near 'tru}'``); a body that ends early
    says so."""
    if message == "Input data was truncated":
        return "the body ends before the JSON does (a missing closing bracket, brace or quote?)"
    match = _AT_BYTE.search(message)
    if match is None:
        return message
    at = min(int(match.group("at")), len(raw))
    line = raw.count(b"\n", 0, at) + 1
    column = at - (raw.rfind(b"\n", 0, at) + 1) + 1
    near = raw[at:at + 16].decode("utf-8", errors="replace").splitlines()[0] if at < len(raw) else ""
    text = message[: match.start()].removeprefix("JSON is malformed: ")
    return f"{text} at line {line}, column {column}" + (f", near {near!r}" if near else "")


# -- exception handlers ---------------------------------------------------------------------


def log_refusal(request: Request, error: APIError) -> None:
    """The one line a refused request leaves (no traceback; the path without its query,
    where a token could be) with its reason, and its count in the app's metrics (the
    app's ``state.metrics``, :class:`service.events.metrics.ServiceMetrics`, by the
    route's path, or by the path of a route headroom answers 501 for
    (:data:`~service.common.unserved_routes.UNSERVED_ROUTES`); a path no route has is
    not counted). Nothing for an error the
    generation runner already logged (:attr:`APIError.logged`)."""
    if error.logged:
        return
    error.logged = True
    log.info(
        "%s %s -> %d %s%s%s: %s",
        request.method,
        clip(request.url.path),
        error.status,
        error.type,
        f" ({error.code})" if error.code else "",
        f" param={error.param}" if error.param else "",
        error.message,
    )
    route = request.scope.get("path_template") or unserved_path(request.url.path)
    metrics = getattr(request.app.state, "metrics", None)
    if route and metrics is not None:
        metrics.call_refused(route, error.status)


def _response(error: APIError, request: Request | None = None) -> Response[Any]:
    if request is not None:
        log_refusal(request, error)
    return Response(content=error.body(), status_code=error.status, headers=error.headers)


def _api_error(request: Request, exc: APIError) -> Response[Any]:
    return _response(exc, request)


def _not_ready(request: Request, exc: NotReady) -> Response[Any]:
    return _response(from_not_ready(exc), request)


def _template_error(request: Request, exc: ChatTemplateError) -> Response[Any]:
    return _response(invalid(exc.message, exc.param), request)


def _rejected(request: Request, exc: RequestRejected) -> Response[Any]:
    return _response(from_rejected(exc), request)


def _http_error(request: Request, exc: HTTPException) -> Response[Any]:
    status, headers = exc.status_code, exc.headers
    if status == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        error = APIError(
            413,
            f"the request body is larger than this server takes ({limit} bytes); "
            "send a smaller one or raise --max-body-size",
            code="request_too_large",
        )
    elif status == 404 and (unserved := unserved_route(request.url.path)) is not None:
        # Not a fault that passes: the OpenAI and Anthropic SDKs retry a 5xx unless told not to.
        error = APIError(501, unserved, code="not_implemented", headers={"x-should-retry": "false"})
    elif status == 404:
        error = APIError(
            404,
            f"no route for {request.method} {clip(request.url.path)}: see /schema/openapi.json for the routes served",
            type=NOT_FOUND,
            code="route_not_found",
        )
    elif status == 405:
        headers = allow_head(headers)
        error = APIError(405, not_allowed(request.method, request.url.path, headers),
                         code="method_not_allowed")
    elif status >= 500:
        error = APIError(status, str(exc.detail), type=SERVER_ERROR)
    elif status == 400:
        error = invalid(str(exc.detail))
    else:
        error = APIError(status, str(exc.detail))
    error.headers.update(headers or {})
    return _response(error, request)


def allow_head(headers: dict[str, str] | None) -> dict[str, str]:
    """A 405's headers with ``HEAD`` named in ``Allow`` beside ``GET``: every ``GET``
    route answers ``HEAD`` (:class:`service.http.head.HeadAsGet`), but the router lists
    only the methods its handlers declare. ``headers`` itself is left as it was."""
    out = dict(headers or {})
    key = next((k for k in out if k.lower() == "allow"), "allow")
    methods = [m.strip() for m in out.get(key, "").split(",") if m.strip()]
    if "GET" in methods and "HEAD" not in methods:
        methods.insert(methods.index("GET") + 1, "HEAD")
        out[key] = ", ".join(methods)
    return out


def not_allowed(method: str, path: str, headers: dict[str, str] | None) -> str:
    """A 405's message naming the methods ``path`` takes, from the router's ``Allow``
    header (``GET /api/control/cache is not served: use POST``); ``OPTIONS``, which every
    route answers for CORS, is left out."""
    path = clip(path)
    allow = (headers or {}).get("allow") or (headers or {}).get("Allow") or ""
    methods = [m.strip() for m in allow.split(",") if m.strip() and m.strip() != "OPTIONS"]
    if not methods:
        return f"{method} {path} is not served: this path takes other methods"
    return f"{method} {path} is not served: use {' or '.join(methods)}"


def _unexpected(request: Request, exc: Exception) -> Response[Any]:
    log.exception("unexpected error in %s %s", request.method, clip(request.url.path))
    return _response(
        APIError(500, f"internal error: {type(exc).__name__}: {exc}", type=SERVER_ERROR), request
    )


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    APIError: _api_error,
    NotReady: _not_ready,
    ChatTemplateError: _template_error,
    RequestRejected: _rejected,
    HTTPException: _http_error,
    Exception: _unexpected,
}


def reshaped_handlers(
    shape: Callable[[int, dict[str, Any]], tuple[int, Any]],
) -> dict[type[Exception], Any]:
    """:data:`EXCEPTION_HANDLERS` for an API with its own error shape (Ollama's,
    Anthropic's): each answers as its OpenAI-shaped twin would, then ``shape(status,
    error)`` (``error``: OpenAI's error object, ``message``, ``type``, ``param``,
    ``code``) gives the status and body sent instead; the headers (Retry-After,
    WWW-Authenticate) are kept."""

    def wrap(handler: Callable[[Request, Any], Response[Any]]) -> Callable[..., Response[Any]]:
        def handle(request: Request, exc: Exception) -> Response[Any]:
            response = handler(request, exc)
            body = response.content
            error = body.get("error") if isinstance(body, dict) else None
            if not isinstance(error, dict):
                error = error_body(str(exc), SERVER_ERROR)["error"]
            status, content = shape(response.status_code, error)
            return Response(content=content, status_code=status, headers=dict(response.headers))

        return handle

    return {kind: wrap(handler) for kind, handler in EXCEPTION_HANDLERS.items()}
