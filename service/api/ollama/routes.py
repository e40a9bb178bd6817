"""Ollama's API under ``/api``: ``POST /api/chat``, ``POST /api/generate``,
``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``.

Generation runs on the path of the OpenAI routes: the body decoded
(:mod:`service.api.ollama.schemas`), one
:class:`~service.api.request.GenerationRequest` built from it
(:mod:`service.api.ollama.requests`), readiness and the model checked, the shared
runner (:meth:`service.api.generation.Generation.start`), then Ollama's answer
(:mod:`service.api.ollama.answers`). So admission (``queue_full``), the context checks,
the supervisor's restarts and retries, OOM isolation, ``--request-timeout`` and client
disconnects behave as on ``/v1``. Errors are Ollama's ``{"error": "message"}`` with the
same status as on ``/v1`` (in a stream: an ``{"error": ...}`` line, then the stream
ends).

These names do not clash with the service's own ``/api`` routes (``health``, ``status``,
``events``, ``control``). With ``--api-key`` they need it as ``/v1`` does (the guard is
added where the app is built, :func:`service.http.app.create_app`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post

from engine.text.chat import template_has_tools
from service.api.generation import Generation
from service.api.ollama.answers import chat_answer, generate_answer
from service.api.ollama.loading import keep_alive_s, load_or_unload, unload_after, wants_unload
from service.api.ollama.models import details, models, modified_at, ollama_name, rfc3339
from service.api.ollama.requests import (
    OPTION_OF_FIELD,
    chat_request,
    generate_request,
    untemplated_chat,
    untemplated_generate,
)
from service.api.ollama.schemas import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaModelList,
    OllamaShow,
    OllamaShowRequest,
    OllamaVersion,
)
from service.api.reasoning import template_thinks
from service.api.request import GenerationRequest, build_call, read_body
from service.api.responses import json_response
from service.api.services import Services
from service.api.start import start_generation
from service.common.engine_states import NotReady
from service.common.errors import MISSING_FIELD, invalid, reshaped_handlers
from service.common.version import headroom_version

# Ollama unloads an idle model after keep_alive; this server keeps it while it runs.
_KEPT_FOR = timedelta(days=365)


# Ollama's error body, ``{"error": message}``, with the status the other APIs answer.
OLLAMA_EXCEPTION_HANDLERS = reshaped_handlers(
    lambda status, error: (status, {"error": error["message"]})
)

# The first path segment under /api of each of Ollama's routes served here.
OLLAMA_ROUTES = frozenset({"chat", "generate", "tags", "ps", "show", "version"})


def speaks_ollama(path: str, status: int) -> bool:
    """Whether an HTTP error raised before any handler ran (no route: 404; a route
    without that method: 405) answers in Ollama's shape: any 404 under ``/api/`` (an
    Ollama client asking for a route this server lacks, ``/api/pull``), and a 405 on
    one of :data:`OLLAMA_ROUTES`. headroom's own ``/api`` routes keep the OpenAI shape."""
    if not path.startswith("/api/"):
        return False
    return status == 404 or path.removeprefix("/api/").split("/", 1)[0] in OLLAMA_ROUTES


def _loads_only(body: OllamaChatRequest | OllamaGenerateRequest, given: object) -> bool:
    """Whether a chat or generate call only loads or unloads the model: ``given`` (its
    messages or prompt) is empty. Either way the call names its model (Ollama's chat
    and generate calls do, a load or unload too) and a valid ``keep_alive``.

    Raises:
        APIError: 400 ``model`` (Ollama's words: ``model is required``), or 400
            ``keep_alive`` for a value that is no duration.
    """
    if not body.model:
        raise invalid("model is required", "model", MISSING_FIELD)
    keep_alive_s(body.keep_alive)
    return not given


async def _generate(
    request: Request,
    svc: Services,
    body: OllamaChatRequest | OllamaGenerateRequest,
    started: float,
    request_of: Callable[..., GenerationRequest],
    answer: Callable[[Generation, Request, str], Awaitable[Response[Any]]],
    untemplated: Callable[[GenerationRequest], GenerationRequest],
) -> Response[Any]:
    """One chat or generate call on the shared runner: the generation request
    ``request_of(body, default_max_tokens=...)`` builds (``untemplated`` it, on a
    model without a chat template), started on the served model, answered by
    ``answer`` (a stream unless the body says ``"stream": false``)."""
    build = partial(request_of, default_max_tokens=svc.settings.default_max_tokens)
    call = build_call(request, body, build, "ollama", started)
    gen, _ = await start_generation(svc, body.model, call, untemplated=untemplated)
    # Answers name the model as /api/tags lists it, whichever alias asked.
    sent = await answer(gen, request, ollama_name(svc, svc.supervisor.info or svc.supervisor.check_ready()))
    return unload_after(svc, sent, gen.start_number) if wants_unload(body.keep_alive) else sent


class OllamaController(Controller):
    """Ollama's API under ``/api`` (see the module docstring)."""

    path = "/api"
    exception_handlers = OLLAMA_EXCEPTION_HANDLERS

    @post("/chat", status_code=200)
    async def chat(self, request: Request, svc: Services) -> Response[Any]:
        """A chat answer, streamed as NDJSON unless ``"stream": false``; without
        messages, the model loaded (or unloaded, ``keep_alive`` 0) and an answer at
        once (:mod:`service.api.ollama.loading`)."""
        body, started = await read_body(request, OllamaChatRequest)
        if _loads_only(body, body.messages):
            return await load_or_unload(svc, body)
        return await _generate(request, svc, body, started, chat_request, chat_answer, untemplated_chat)

    @post("/generate", status_code=200)
    async def generate(self, request: Request, svc: Services) -> Response[Any]:
        """A completion of ``prompt`` (through the chat template unless ``raw`` or the
        model has none),
        streamed as NDJSON unless ``"stream": false``; an empty prompt loads (or
        unloads) the model as an empty chat does."""
        body, started = await read_body(request, OllamaGenerateRequest)
        if _loads_only(body, body.prompt):
            return await load_or_unload(svc, body)
        return await _generate(
            request, svc, body, started, generate_request, generate_answer, untemplated_generate(body)
        )

    @get("/tags")
    async def list_tags(self, svc: Services) -> Response[bytes]:
        """The served model, once, under the name :func:`~service.api.ollama.models.ollama_name`
        gives it (``/v1/models`` lists every name it answers to)."""
        info = svc.supervisor.info or svc.supervisor.check_ready()
        return json_response(OllamaModelList(models=models(svc, info)))

    @get("/ps")
    async def running(self, svc: Services) -> Response[bytes]:
        """The loaded model (none while no worker is ready): its memory (weights plus
        the KV cache's buffers, in bytes; on the GPU unless the device is the CPU) and
        the context one request can use now."""
        try:
            info = svc.supervisor.check_ready()
        except NotReady:
            return json_response(OllamaModelList(models=[]))
        size = info.weight_bytes + info.kv_buffer_bytes
        expires = rfc3339(datetime.now(timezone.utc) + _KEPT_FOR)
        running = [
            msgspec.structs.replace(
                m,
                expires_at=expires,
                size=size,
                size_vram=0 if info.device == "cpu" else size,
                context_length=info.max_context_tokens,
            )
            for m in models(svc, info)
        ]
        return json_response(OllamaModelList(models=running))

    @post("/show", status_code=200)
    async def show_model(self, request: Request, svc: Services) -> Response[bytes]:
        """The model's details, sampling defaults, chat template and capabilities;
        400 ``model is required`` without ``model`` (or ``name``), as Ollama answers."""
        body, _ = await read_body(request, OllamaShowRequest)
        if not (body.model or body.name):
            raise invalid("model is required", "model", MISSING_FIELD)
        info = svc.supervisor.info or svc.supervisor.check_ready()
        svc.check_model(body.model or body.name, info)
        template = getattr(svc.text.tokenizer, "chat_template", None) if svc.text else None
        template = template if isinstance(template, str) else ""
        d = details(info)
        defaults = svc.sampling_defaults
        # Modelfile names, as Ollama's own parameters text has them (repeat_penalty...).
        parameters = "\n".join(f"{OPTION_OF_FIELD.get(k, k)} {v}" for k, v in defaults.as_dict().items())
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
        return json_response(
            OllamaShow(
                modelfile="",
                parameters=parameters,
                template=template,
                details=d,
                model_info=model_info,
                capabilities=capabilities,
                modified_at=modified_at(svc),
            )
        )

    @get("/version")
    async def version_info(self) -> Response[bytes]:
        """headroom's version (not an Ollama version)."""
        return json_response(OllamaVersion(version=headroom_version()))
