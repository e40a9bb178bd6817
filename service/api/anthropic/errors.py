"""Every error of Anthropic's routes in Anthropic's shape, mapped from the service's one
error (:class:`service.common.errors.APIError`).

``{"type": "error", "error": {"type": ..., "message": ...}}`` with Anthropic's status
codes: 400 ``invalid_request_error``, 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429
``rate_limit_error``, 500 ``api_error``, 504 ``timeout_error``, and 529
``overloaded_error`` for what the other APIs answer 503 (the engine starting or
restarting, ``queue_full``, out of memory; Retry-After kept). A prompt too long for the
context says ``prompt is too long`` first, the words Anthropic's clients look for to
compact a conversation. The message is the service's own, with the field at fault
(``param``) named in it; ``code`` has no place in this shape and is left out.
"""

from __future__ import annotations

from service.api.anthropic.schemas import AnthropicError, AnthropicErrorDetail
from service.common.errors import APIError, reshaped_handlers

OVERLOADED = 529  # Anthropic's status for "try again later"

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}
_TOO_LONG = "prompt is too long: "


def anthropic_error(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> tuple[int, AnthropicError]:
    """The status and body Anthropic's routes answer for an error the other APIs answer
    with ``status``, ``message``, ``code`` and ``param`` (named in the message, which
    is all this shape has)."""
    if code == "context_length_exceeded":
        message = message if message.startswith(_TOO_LONG) else _TOO_LONG + message
    elif param and param not in message:
        message = f"{param}: {message}"
    if status == 503:
        status = OVERLOADED
    kind = _TYPE_OF_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, AnthropicError(error=AnthropicErrorDetail(type=kind, message=message))


def error_payload(exc: APIError) -> AnthropicError:
    """A stream's ``error`` event for an error after the stream began."""
    return anthropic_error(exc.status, exc.message, exc.code, exc.param)[1]


ANTHROPIC_EXCEPTION_HANDLERS = reshaped_handlers(
    lambda status, error: anthropic_error(status, error["message"], error["code"], error["param"])
)

ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether an HTTP error raised before any handler ran (no route: 404; a route
    without that method: 405) answers in Anthropic's shape: ``/v1/messages`` and any
    path under it."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
