"""The service's OpenAPI 3.1 document, served at ``GET /schema/openapi.json``.

Built from the same msgspec types the routes decode and encode (request bodies,
answers, the error object), not from handler signatures: the OpenAI routes decode
their bodies themselves (so every defect answers OpenAI's 400 with ``param``), which
a signature-based generator could not see. Each operation lists every status it may
answer, with its body: 200/202, 400 (the request), 401 (a missing API key or local
token), 403 (a refused Origin), 404 (a model or route), 413 (``--max-body-size``), 415
(a compressed body), 503 (engine not ready, ``queue_full`` or ``out_of_memory``, with
Retry-After), 504 (``--request-timeout``), and 500 only for a bug. Streaming answers
(``"stream": true``) are ``text/event-stream``: ``data: <chunk JSON>`` events, then
``data: [DONE]``. Ollama's routes (``/api/chat``, ``/api/generate``, ``/api/tags``,
``/api/ps``, ``/api/show``, ``/api/version``) are listed too, with Ollama's error body
``{"error": message}`` and NDJSON streams, and Anthropic's (``/v1/messages``,
``/v1/messages/count_tokens``) with Anthropic's error body and status codes (529
where the others answer 503) and its named events.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from litestar import Response, get

from service.api.anthropic import schemas as anthropic
from service.api.ollama import schemas as ollama
from service.api.openai import schemas as openai
from service.api.openai.responses_schemas import ResponseObject, ResponsesRequest
from service.events.control_schemas import CacheRequest, ControlResponse, ReserveRequest
from service.events.schemas import Snapshot

SCHEMA_PATH = "/schema/openapi.json"
_REF = "#/components/schemas/{name}"

_ERROR_TEXT = {
    400: "The request cannot be served as sent; `param` names the field.",
    401: "A valid secret is required as `Authorization: Bearer <secret>`.",
    403: "The Origin or Host is not allowed.",
    404: "No such model (or route).",
    405: "Method not allowed.",
    408: "The body did not arrive whole within 30 s (a Content-Length larger than the body).",
    409: "The action conflicts with the engine's state (e.g. while it restarts).",
    413: "The body is larger than --max-body-size.",
    415: "The body was sent compressed (Content-Encoding); send it uncompressed.",
    500: "A bug in the server.",
    501: "The action is not supported here.",
    503: "The engine is not ready, too many requests wait for it (queue_full), or the "
    "device ran out of memory for this request; see Retry-After.",
    504: "The request ran past --request-timeout.",
    529: "Anthropic's routes: what the others answer 503 (engine not ready, queue_full, "
    "out of memory); see Retry-After.",
}


def _json(schema_name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=schema_name)}}}


def _errors(*statuses: int, schema: str = "ErrorResponse") -> dict[str, Any]:
    """The error answers of an operation; Ollama's routes use their own shape,
    ``OllamaError`` (``{"error": message}``)."""
    return {str(s): {"description": _ERROR_TEXT[s], "content": _json(schema)} for s in statuses}


_BEARER = [{"bearer": []}]
_GENERATION_ERRORS = (400, 401, 403, 404, 405, 408, 413, 415, 500, 503, 504)
_CONTROL_ERRORS = (400, 401, 403, 405, 409, 413, 500, 501, 503)


_SSE = (
    "text/event-stream",
    "The completion; with `stream: true`, Server-Sent Events ending with `data: [DONE]` "
    '(an error after the stream began is an `{"error": ...}` event before it).',
)
_NDJSON = (
    "application/x-ndjson",
    "With `stream` true (Ollama's default), one JSON object a line (NDJSON), the last "
    "with `done: true`; else one object.",
)


# One item of a streamed answer as a client reads it: an NDJSON line's or an SSE event's
# text, or an SSE event with its fields (``event:`` and ``data:``) apart.
_STREAM_ITEM = {"type": ["string", "object"], "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def _generation(
    request: str,
    answer: str,
    summary: str,
    stream: tuple[str, str] = _SSE,
    error_schema: str = "ErrorResponse",
) -> dict[str, Any]:
    """A generating route: its body, its answer whole or streamed (``stream``: the
    media type and its description) and its errors."""
    media_type, description = stream
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": description,
                    "content": {**_json(answer), media_type: {"schema": _STREAM_ITEM}},
                },
                **_errors(*_GENERATION_ERRORS, schema=error_schema),
            },
        }
    }


_ANTHROPIC_SSE = (
    "text/event-stream",
    "The message; with `stream: true`, Anthropic's events (`event: message_start`, "
    "`ping`, `content_block_start`, `content_block_delta`, `content_block_stop`, "
    "`message_delta`, `message_stop`; an `error` event for an error after the stream "
    "began).",
)
_ANTHROPIC_ERRORS = (400, 401, 403, 404, 405, 408, 413, 415, 500, 504, 529)


def _anthropic_paths() -> dict[str, Any]:
    """Anthropic's Messages API (:mod:`service.api.anthropic.routes`); the key goes as
    ``x-api-key`` or a bearer token."""
    count = _generation("CountTokensRequest", "TokenCount", "Count a message's prompt tokens.")
    count["post"]["responses"]["200"] = {
        "description": "The prompt's tokens.",
        "content": _json("TokenCount"),
    }
    messages = _generation(
        "MessagesRequest", "Message", "Anthropic Messages.", _ANTHROPIC_SSE, "AnthropicError"
    )
    for operation in (messages["post"], count["post"]):
        operation["security"] = [*_BEARER, {"x-api-key": []}]
        operation["responses"] = {
            "200": operation["responses"]["200"],
            **_errors(*_ANTHROPIC_ERRORS, schema="AnthropicError"),
        }
        operation["responses"]["400"]["description"] = (
            "The request cannot be served as sent; the message names the field."
        )
        operation["responses"]["401"]["description"] = (
            "The API key is required as `x-api-key: <key>` or `Authorization: Bearer <key>`."
        )
    return {"/v1/messages": messages, "/v1/messages/count_tokens": count}


def _control(request: str | None, summary: str) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "security": _BEARER,
        "responses": {
            "202": {"description": "Done (or started).", "content": _json("ControlResponse")},
            **_errors(*_CONTROL_ERRORS),
        },
    }
    if request is not None:
        operation["requestBody"] = {"required": True, "content": _json(request)}
    return {"post": operation}


def _ollama_get(answer: str, summary: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "security": _BEARER,
            "responses": {
                "200": {"description": summary, "content": _json(answer)},
                **_errors(401, 403, 405, 500, 503, schema="OllamaError"),
            },
        }
    }


def _ollama_paths() -> dict[str, Any]:
    """Ollama's native API beside OpenAI's (:mod:`service.api.ollama.routes`)."""
    return {
        "/api/chat": _generation(
            "OllamaChatRequest", "OllamaChatChunk", "Ollama chat.", _NDJSON, "OllamaError"
        ),
        "/api/generate": _generation(
            "OllamaGenerateRequest", "OllamaGenerateChunk", "Ollama generate.", _NDJSON, "OllamaError"
        ),
        "/api/tags": _ollama_get("OllamaModelList", "The served model, as Ollama lists models."),
        "/api/ps": _ollama_get("OllamaModelList", "The running model, as Ollama lists them."),
        "/api/version": _ollama_get("OllamaVersion", "The Ollama API version answered."),
        "/api/show": {
            "post": {
                "summary": "A model's details, template and sampling defaults.",
                "security": _BEARER,
                "requestBody": {"required": True, "content": _json("OllamaShowRequest")},
                "responses": {
                    "200": {"description": "The model.", "content": _json("OllamaShow")},
                    **_errors(400, 401, 403, 404, 405, 408, 413, 415, 500, 503, schema="OllamaError"),
                },
            }
        },
    }


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document as a dict (see the module docstring)."""
    _, components = msgspec.json.schema_components(
        [
            openai.ChatCompletionRequest,
            openai.CompletionRequest,
            openai.ChatCompletion,
            openai.Completion,
            openai.ModelList,
            openai.ModelCard,
            openai.ErrorResponse,
            ResponsesRequest,
            ResponseObject,
            Snapshot,
            ControlResponse,
            ReserveRequest,
            CacheRequest,
            ollama.OllamaChatRequest,
            ollama.OllamaGenerateRequest,
            ollama.OllamaChatChunk,
            ollama.OllamaGenerateChunk,
            ollama.OllamaModelList,
            ollama.OllamaShowRequest,
            ollama.OllamaShow,
            ollama.OllamaVersion,
            ollama.OllamaError,
            anthropic.MessagesRequest,
            anthropic.CountTokensRequest,
            anthropic.Message,
            anthropic.TokenCount,
            anthropic.AnthropicError,
        ],
        ref_template=_REF,
    )
    health = {
        "description": "The engine's state (`status`: ready, starting, restarting, failed).",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    paths = {
        "/v1/models": {
            "get": {
                "summary": "The served model; `context_length` is the context one request "
                "can use now (it follows the KV pool). With an `anthropic-version` header, "
                "Anthropic's list (`data`, `has_more`, `first_id`, `last_id`).",
                "security": [*_BEARER, {"x-api-key": []}],
                "responses": {
                    "200": {"description": "The model list.", "content": _json("ModelList")},
                    **_errors(401, 403, 503),
                },
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One served model by a name `/v1/models` lists (OpenAI's retrieve; "
                "with an `anthropic-version` header, Anthropic's model object).",
                "security": [*_BEARER, {"x-api-key": []}],
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {
                    "200": {"description": "The model.", "content": _json("ModelCard")},
                    **_errors(401, 403, 404, 503),
                },
            }
        },
        "/v1/chat/completions": _generation(
            "ChatCompletionRequest", "ChatCompletion", "Chat completion."
        ),
        "/v1/completions": _generation("CompletionRequest", "Completion", "Text completion."),
        "/v1/responses": _generation(
            "ResponsesRequest",
            "ResponseObject",
            "OpenAI's Responses API (stateless); with `stream: true`, `event:`/`data:` "
            "Server-Sent Events ending with `response.completed`.",
        ),
        "/api/health": {
            "get": {
                "summary": "Is the engine serving.",
                "responses": {"200": health, "503": health, **_errors(403)},
            }
        },
        "/api/status": {
            "get": {
                "summary": "The event hub's snapshot.",
                "responses": {
                    "200": {"description": "The snapshot.", "content": _json("Snapshot")},
                    **_errors(401, 403),
                },
            }
        },
        "/api/control/restart": _control(None, "Restart the worker."),
        "/api/control/pause": _control(
            None, "Pause: stop the worker and give its memory back (state `paused`)."
        ),
        "/api/control/resume": _control(None, "Load the worker again after a pause."),
        "/api/control/reserve": _control("ReserveRequest", "Set the memory reserve."),
        "/api/control/cache": _control(
            "CacheRequest",
            "Resize the KV pool, the GPU expert cache or the CPU's layers, and/or clear the "
            "prefix cache (`clear_prefix_cache: true`, done last).",
        ),
        **_ollama_paths(),
        **_anthropic_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "headroom", "version": "0.1.0"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


@get(SCHEMA_PATH, sync_to_thread=False, include_in_schema=False)
def openapi_route() -> Response[bytes]:
    """``GET /schema/openapi.json`` (open, like ``/api/health``)."""
    return Response(_encoded(), media_type="application/json")


@functools.cache
def _encoded() -> bytes:
    return msgspec.json.encode(openapi_document())
