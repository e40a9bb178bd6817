"""What the engine's and the supervisor's failures of a running call answer: the
:class:`~service.common.errors.APIError` each one becomes, raised by
:meth:`service.api.generation.Generation.pieces`.

A sequence the engine ended with ``finish_reason="error"`` (:func:`engine_error`), one it
refused to queue (:func:`rejected`), a worker that died under it (:func:`failure`, 503
with Retry-After while it restarts) and a call past ``--request-timeout``
(:func:`timed_out`, 504).
"""

from __future__ import annotations

from engine.wire.ipc import Rejected
from engine.wire.messages import ERROR_INVALID_SCHEMA
from service.common.engine_states import ENGINE_PAUSED, ENGINE_RESTARTED
from service.common.errors import SERVER_ERROR, APIError, invalid
from service.supervision.inflight import EngineFailure

# Seconds a client should wait before retrying a request that ran out of device
# memory: the engine has rolled back and shrunk its steps by then, and memory another
# process held for a moment may be back.
OOM_RETRY_AFTER_S = 1
OUT_OF_MEMORY = "out_of_memory"
REQUEST_TIMEOUT = "request_timeout"


def schema_refused(message: str | None, param: str) -> APIError:
    """400 for a JSON schema the engine's grammar refused (a keyword or pattern it
    cannot enforce, or a compile past its time): the request's fault. The message
    starts with the field the schema came from (``response_format``, Ollama's
    ``format``, ``tools`` for a forced call's parameters), as Ollama's errors carry
    no ``param``."""
    return invalid(f"{param}: {message or 'the JSON schema cannot be used'}", param)


def engine_error(code: str | None, message: str | None, schema_param: str = "response_format") -> APIError:
    """The API error for a sequence the engine ended with ``finish_reason="error"``.

    ``invalid_schema`` is :func:`schema_refused` blaming ``schema_param``.

    ``out_of_memory`` (the request did not fit in device memory even alone; the engine
    stayed up) is a 503 with Retry-After: the same request may well run later. Any
    other code is a 500 carrying the engine's code (``engine_error`` when it gave none).
    """
    if code == ERROR_INVALID_SCHEMA:
        return schema_refused(message, schema_param)
    if code == OUT_OF_MEMORY:
        return APIError(
            503,
            message or "the device ran out of memory for this request; retry later",
            type=SERVER_ERROR,
            code=OUT_OF_MEMORY,
            headers={"Retry-After": str(OOM_RETRY_AFTER_S)},
        )
    return APIError(
        500,
        message or "the engine failed this request",
        type=SERVER_ERROR,
        code=code or "engine_error",
    )


def rejected(event: Rejected, schema_param: str = "response_format") -> APIError:
    """A sequence the engine refused to queue: 400 naming the field it names (a
    refused schema as :func:`schema_refused` blaming ``schema_param``)."""
    if event.param == "response_format":
        return schema_refused(event.message, schema_param)
    return APIError(400, event.message, param=event.param, code=event.code)


def failure(event: EngineFailure, retry_after_s: int | None) -> APIError:
    """503 for a sequence the worker's death ended (``engine_restarted``, and
    ``engine_paused`` for one an unload ended, carry Retry-After, the supervisor's
    ``retry_after_s``, when it is known)."""
    headers = {}
    if event.code in (ENGINE_RESTARTED, ENGINE_PAUSED) and retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return APIError(503, event.message, type=SERVER_ERROR, code=event.code, headers=headers)


def timed_out() -> APIError:
    """504 ``request_timeout``: the call ran past ``--request-timeout``."""
    return APIError(
        504,
        "the request took longer than this server allows (--request-timeout); "
        "ask for fewer tokens or retry later",
        type=SERVER_ERROR,
        code=REQUEST_TIMEOUT,
    )
