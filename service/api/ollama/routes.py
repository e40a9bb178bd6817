"""Ollama's API under ``/api``: ``POST /api/chat``, ``POST /api/generate``,
``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``.

Generation runs on the OpenAI routes' path (:func:`service.api.chat_generation.start_chat`
on the request :mod:`service.api.ollama.mapping` builds), so admission
(``queue_full``), the context checks, the supervisor's restarts and retries, OOM
isolation, ``--request-timeout`` and client disconnects behave as on ``/v1``. Streams
(the default, as in Ollama) are NDJSON: one JSON object a line, the last with
``"done": true``, ``done_reason`` (``stop``, ``length``), the token counts and the
durations in nanoseconds. Errors are Ollama's ``{"error": "message"}`` with the same
status as on ``/v1`` (in a stream: an ``{"error": ...}`` line, then the stream ends).

These names do not clash with the service's own ``/api`` routes (``health``, ``status``,
``events``, ``control``). With ``--api-key`` they need it as ``/v1`` does (the guard is
added where the app is built, :func:`service.http.app.create_app`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from engine.wire.messages import EngineInfo
from engine.text.chat import template_has_tools
from service.api.chat_generation import start_chat
from service.api.chat_output import FINISH_TOOL_CALLS, ChatOutput
from service.common.errors import EXCEPTION_HANDLERS, APIError, decode_body
from service.api.generation import Generation
from service.api.ollama.mapping import Mapped, chat_request, details, generate_request, model_name
from service.api.ollama.schemas import (
    OllamaChatChunk,
    OllamaChatRequest,
    OllamaGenerateChunk,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaModel,
    OllamaModelList,
    OllamaShow,
    OllamaShowRequest,
    OllamaVersion,
)
from service.api.reasoning import template_thinks
from service.api.responses import CLIENT_GONE, log_request, respond_with
from service.api.services import Services
from service.common.engine_states import NotReady
from service.common.version import headroom_version

log = logging.getLogger("headroom.api")

_encoder = msgspec.json.Encoder()
_NDJSON = "application/x-ndjson"
# Ollama unloads an idle model after keep_alive; this server keeps it while it runs.
_KEPT_FOR = timedelta(days=365)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _json(payload: Any, status: int = 200) -> Response[bytes]:
    return Response(
        content=_encoder.encode(payload), media_type="application/json", status_code=status
    )


def _ollama_error(handler: Callable[[Request, Any], Response[Any]]) -> Callable[..., Response[Any]]:
    """``handler`` (one of the OpenAI-shaped handlers) with Ollama's body: the same
    status and headers, ``{"error": message}``."""

    def handle(request: Request, exc: Exception) -> Response[Any]:
        response = handler(request, exc)
        body = response.content
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(exc)
        return Response(
            content={"error": message},
            status_code=response.status_code,
            headers=dict(response.headers),
        )

    return handle


OLLAMA_EXCEPTION_HANDLERS = {kind: _ollama_error(h) for kind, h in EXCEPTION_HANDLERS.items()}


def _timings(gen: Generation, done_reason: str | None) -> dict[str, Any]:
    """The last line's fields: done_reason, counts, durations (ns). The prompt's time
    is the time to the first token; the answer's is the rest."""
    total_s = time.perf_counter() - gen.started
    ttft_s = (gen.ttft_ms or 0.0) / 1000.0
    return {
        "done_reason": done_reason or "stop",
        "total_duration": int(total_s * 1e9),
        "load_duration": 0,
        "prompt_eval_count": gen.prompt_tokens,
        "prompt_eval_duration": int(ttft_s * 1e9),
        "eval_count": gen.completion_tokens,
        "eval_duration": int(max(total_s - ttft_s, 0.0) * 1e9),
    }


@dataclass
class _Part:
    """What one line carries: answer text, thinking, complete tool calls."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls)


def _ollama_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI call's name and JSON text arguments as Ollama's call (arguments an
    object; text that is not a JSON object is kept as text)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return {"function": {"name": name, "arguments": parsed}}


def _done_reason(reason: str | None) -> str | None:
    return "stop" if reason == FINISH_TOOL_CALLS else reason


async def _ndjson(
    gen: Generation,
    output: ChatOutput,
    line: Callable[[_Part, bool, dict[str, Any]], Any],
) -> AsyncIterator[bytes]:
    """A stream of ``line(part, done, timings)`` objects, one a line; an error becomes
    an ``{"error": ...}`` line that ends the stream. A tool call goes out whole, once
    its arguments are complete."""
    status = 200
    reason: str | None = None
    names: dict[int, str] = {}
    try:
        try:
            async for piece in gen.pieces():
                reason = piece.finish_reason or reason
                for choice in output.deltas(0, piece.text, piece.finish_reason, None):
                    delta = choice.delta
                    part = _Part(delta.content or "", delta.reasoning_content or "")
                    for call in delta.tool_calls or []:
                        if "id" in call:
                            names[call["index"]] = call["function"]["name"]
                        else:
                            name = names[call["index"]]
                            part.tool_calls.append(
                                _ollama_call(name, call["function"]["arguments"])
                            )
                    if part:
                        yield _encoder.encode(line(part, False, {})) + b"\n"
            timings = _timings(gen, _done_reason(reason))
            yield _encoder.encode(line(_Part(), True, timings)) + b"\n"
        except APIError as exc:
            status = exc.status
            yield _encoder.encode({"error": exc.message}) + b"\n"
        except Exception as exc:  # a bug: still end the stream in Ollama's shape
            log.exception("%s failed", gen.request_id)
            status = 500
            yield _encoder.encode({"error": f"internal error: {exc}"}) + b"\n"
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_GONE
        raise
    finally:
        gen.close()
        log_request(gen, gen.request_id, status, gen.started)


async def _checked(svc: Services, mapped: Mapped) -> tuple[EngineInfo, str]:
    """Readiness (503; an idle worker is loaded first) and the model name (404), in the
    order ``/v1`` checks them (admission, ``queue_full``, comes next, in
    :func:`start_chat`)."""
    info = await svc.supervisor.ready()
    model = svc.check_model(mapped.request.model, info)
    return info, model


async def _start(
    svc: Services,
    mapped: Mapped,
    started: float,
    *,
    raw_prompt: str | None = None,
) -> tuple[Generation, ChatOutput, str]:
    info, model = await _checked(svc, mapped)
    gen, output = await start_chat(
        mapped.request,
        info,
        svc,
        started,
        f"ollama-{uuid.uuid4().hex}",
        context_tokens=mapped.context_tokens,
        raw_prompt=raw_prompt,
        default_max_tokens=mapped.default_max_tokens,
    )
    return gen, output, model


async def _answer(
    gen: Generation,
    output: ChatOutput,
    request: Request,
    started: float,
    stream: bool,
    line: Callable[[_Part, bool, dict[str, Any]], Any],
) -> Response[Any]:
    """NDJSON lines as the text comes, or one object (``line(part, True, timings)``)
    when it is complete."""
    if stream:
        return Stream(_ndjson(gen, output, line), media_type=_NDJSON)

    def build(texts: list[str], reasons: list[str | None]) -> Any:
        message, reason = output.message(texts[0], reasons[0])
        calls = [
            _ollama_call(c["function"]["name"], c["function"]["arguments"])
            for c in (message.tool_calls or [])
        ]
        part = _Part(message.content or "", message.reasoning_content or "", calls)
        return line(part, True, _timings(gen, _done_reason(reason)))

    return await respond_with(gen, request, build)


class OllamaController(Controller):
    """Ollama's API under ``/api`` (see the module docstring)."""

    path = "/api"
    exception_handlers = OLLAMA_EXCEPTION_HANDLERS

    @post("/chat", status_code=200)
    async def chat(self, request: Request, svc: Services) -> Response[Any]:
        """A chat answer, streamed as NDJSON unless ``"stream": false``."""
        started = time.perf_counter()
        body = decode_body(await request.body(), OllamaChatRequest)
        gen, output, model = await _start(svc, chat_request(body), started)

        def line(part: _Part, done: bool, timings: dict[str, Any]) -> OllamaChatChunk:
            message = OllamaMessage(role="assistant", content=part.content)
            if part.thinking:
                message.thinking = part.thinking
            if part.tool_calls:
                message.tool_calls = part.tool_calls
            return OllamaChatChunk(
                model=model, created_at=_now(), message=message, done=done, **timings
            )

        return await _answer(gen, output, request, started, body.stream, line)

    @post("/generate", status_code=200)
    async def generate(self, request: Request, svc: Services) -> Response[Any]:
        """A completion of ``prompt`` (through the chat template unless ``raw``),
        streamed as NDJSON unless ``"stream": false``; an empty prompt answers at once
        with ``done_reason: "load"`` once the model is ready."""
        started = time.perf_counter()
        body = decode_body(await request.body(), OllamaGenerateRequest)
        mapped = generate_request(body)
        if not body.prompt:
            info = svc.supervisor.check_ready()
            model = svc.check_model(mapped.request.model, info)
            reason = "unload" if body.keep_alive in (0, "0", "0s") else "load"
            chunk = OllamaGenerateChunk(
                model=model, created_at=_now(), response="", done=True, done_reason=reason
            )
            return _json(chunk)
        gen, output, model = await _start(
            svc, mapped, started, raw_prompt=body.prompt if body.raw else None
        )

        def line(part: _Part, done: bool, timings: dict[str, Any]) -> OllamaGenerateChunk:
            chunk = OllamaGenerateChunk(
                model=model, created_at=_now(), response=part.content, done=done, **timings
            )
            if part.thinking:
                chunk.thinking = part.thinking
            return chunk

        return await _answer(gen, output, request, started, body.stream, line)

    @get("/tags")
    async def list_tags(self, svc: Services) -> Response[bytes]:
        """Every name the served model answers to, as ``/v1/models`` lists them."""
        info = svc.supervisor.info or svc.supervisor.check_ready()
        return _json(OllamaModelList(models=_models(svc, info)))

    @get("/ps")
    async def running(self, svc: Services) -> Response[bytes]:
        """The loaded model (none while no worker is ready): its memory (weights plus
        KV pool, in bytes; on the GPU unless the device is the CPU) and the context one
        request can use now."""
        try:
            info = svc.supervisor.check_ready()
        except NotReady:
            return _json(OllamaModelList(models=[]))
        size = info.weight_bytes + info.kv_cache_bytes
        expires = (datetime.now(timezone.utc) + _KEPT_FOR).isoformat().replace("+00:00", "Z")
        models = [
            msgspec.structs.replace(
                m,
                expires_at=expires,
                size=size,
                size_vram=0 if info.device == "cpu" else size,
                context_length=info.max_context_tokens,
            )
            for m in _models(svc, info)
        ]
        return _json(OllamaModelList(models=models))

    @post("/show", status_code=200)
    async def show_model(self, request: Request, svc: Services) -> Response[bytes]:
        """The model's details, sampling defaults, chat template and capabilities."""
        body = decode_body(await request.body(), OllamaShowRequest)
        info = svc.supervisor.info or svc.supervisor.check_ready()
        svc.check_model(model_name(body.model or body.name), info)
        template = getattr(svc.text.tokenizer, "chat_template", None) if svc.text else None
        template = template if isinstance(template, str) else ""
        d = details(info)
        defaults = svc.sampling_defaults
        parameters = "\n".join(f"{k} {v}" for k, v in defaults.as_dict().items())
        capabilities = ["completion"]
        if svc.text is not None and template_has_tools(svc.text.tokenizer):
            capabilities.append("tools")
        if template_thinks(template):
            capabilities.append("thinking")
        model_info = {
            "general.architecture": d.family,
            "general.basename": info.model_name,
            f"{d.family}.context_length": info.model_context_tokens,
            f"{d.family}.vocab_size": info.vocab_size,
        }
        return _json(
            OllamaShow(
                modelfile="",
                parameters=parameters,
                template=template,
                details=d,
                model_info=model_info,
                capabilities=capabilities,
                modified_at=_modified_at(svc),
            )
        )

    @get("/version")
    async def version_info(self) -> Response[bytes]:
        """headroom's version (not an Ollama version)."""
        return _json(OllamaVersion(version=headroom_version()))


def _modified_at(svc: Services) -> str:
    return datetime.fromtimestamp(svc.started_at, timezone.utc).isoformat().replace("+00:00", "Z")


def _models(svc: Services, info: EngineInfo) -> list[OllamaModel]:
    digest = hashlib.sha256(info.model_dir.encode("utf-8")).hexdigest()
    d = details(info)
    return [
        OllamaModel(
            name=name,
            model=name,
            modified_at=_modified_at(svc),
            size=info.weight_bytes,
            digest=digest,
            details=d,
        )
        for name in svc.model_names(info)
    ]
