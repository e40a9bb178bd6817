"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` (stateless: :mod:`service.api.openai.responses_input`), ``/v1/models``.

One path per call, each step once: the body is decoded here (not by Litestar's
signature model) so that every defect in it, empty, not JSON, not an object, a wrong
type, a value out of its declared range, answers OpenAI's 400 with ``param``
(:func:`service.common.errors.decode_body`); it becomes the one
:class:`~service.api.request.GenerationRequest` of the call
(:mod:`service.api.openai.requests`, 400s for fields needing nothing else); then
readiness (503) and the model (404); then the generation runner takes it into the
engine (:meth:`service.api.generation.Generation.start`: admission 503
``queue_full``, ``logit_bias`` ids, a chat's ``tools``/``tool_choice``, the prompt's
bound, tokenizing, ``max_tokens`` against the context, submit); the answer is built
in :mod:`service.api.openai.answers`. With ``--request-timeout``, a request still
running that many seconds after it arrived is aborted in the engine and answered 504
``request_timeout`` (in a stream: an error event, then ``[DONE]``).

Authentication (``--api-key``) is not here but in the guard of the router these
routes are mounted on (:class:`service.common.auth.BearerGuard`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from litestar import Controller, Request, Response, get, post, route

from engine.common.model_names import model_key
from engine.text.chat import ChatTemplateError
from engine.wire.messages import EngineInfo
from service.api.anthropic.models import (
    BY_CLIENT_HANDLERS,
    anthropic_model,
    anthropic_model_list,
    asks_anthropic,
)
from service.api.openai.answers import chat_answer, completion_answer
from service.api.openai.requests import chat_request, completion_request
from service.api.openai.responses_answers import responses_answer
from service.api.openai.responses_input import input_error, not_stored, responses_request
from service.api.openai.responses_schemas import ResponsesRequest
from service.api.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from service.api.request import read_call
from service.api.responses import json_response
from service.api.services import Services
from service.api.start import start_generation

# Anthropic's clients list models too, with their key as x-api-key (see service.common.auth).
_MODELS_OPT = {"key_header": "x-api-key"}


def _card(svc: Services, info: EngineInfo, name: str) -> ModelCard:
    """The model card of ``name`` (one of ``svc.model_names(info)``)."""
    return ModelCard(
        id=name,
        created=svc.started_at,
        context_length=info.max_context_tokens,
        max_model_len=info.max_context_tokens,
        model_context_length=info.model_context_tokens,
    )


class OpenAIController(Controller):
    """OpenAI's API under ``/v1``."""

    path = "/v1"

    @get("/models", opt=_MODELS_OPT, exception_handlers=BY_CLIENT_HANDLERS)
    async def models(self, request: Request, svc: Services) -> Response[bytes]:
        """The served model. ``context_length`` (and ``max_model_len``) is the context
        one request can use *now*, prompt plus completion in tokens: the live limit,
        which follows the KV pool as it shrinks and grows (a request longer than it
        is refused with ``context_length_exceeded``). ``model_context_length`` is the
        model's own. 503 before the first worker is ready. An Anthropic client gets
        Anthropic's list (:mod:`service.api.anthropic.models`)."""
        # The last worker's facts stay valid while it restarts; before the first one
        # is ready, check_ready raises NotReady (503).
        info = svc.supervisor.info or svc.supervisor.check_ready()
        names = svc.model_names(info)
        if asks_anthropic(request):
            return json_response(
                anthropic_model_list(names, info.model_name, svc.started_at, request.query_params)
            )
        return json_response(ModelList(data=[_card(svc, info, name) for name in names]))

    @get("/models/{model_id:path}", opt=_MODELS_OPT, exception_handlers=BY_CLIENT_HANDLERS)
    async def model(self, request: Request, model_id: str, svc: Services) -> Response[bytes]:
        """One served model by a name :meth:`models` lists (OpenAI's retrieve; a name
        with slashes, as a Hugging Face id, included), or one that compares equal to it
        (:func:`~engine.common.model_names.model_key`: ``DEFAULT``, ``default:latest``),
        answered with the name as listed; 404 ``model_not_found`` for any other name, 503
        before the first worker is ready. An Anthropic client gets Anthropic's model object."""
        info = svc.supervisor.info or svc.supervisor.check_ready()
        names = svc.model_names(info)
        name = model_id.lstrip("/")
        if name not in names:
            name = next((n for n in names if name and model_key(n) == model_key(name)), name)
        # check_model takes an empty name for the served model, a retrieve does not.
        if name not in names:
            svc.check_model(name or " ", info)  # raises the 404 naming the served models
        if asks_anthropic(request):
            return json_response(anthropic_model(name, info.model_name, svc.started_at))
        return json_response(_card(svc, info, name))

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, svc: Services) -> Response[Any]:
        """Chat completion, streaming (SSE) or not. Errors: see the module docstring."""
        build = partial(chat_request, default_max_tokens=svc.settings.default_max_tokens)
        body, call = await read_call(request, ChatCompletionRequest, build, "chatcmpl")
        gen, model = await start_generation(svc, body.model, call)
        return await chat_answer(gen, request, model, body.stream_options)

    @post("/completions", status_code=200)
    async def completions(self, request: Request, svc: Services) -> Response[Any]:
        """Text completion of a raw prompt (no chat template), streaming or not."""
        body, call = await read_call(request, CompletionRequest, completion_request, "cmpl")
        gen, model = await start_generation(svc, body.model, call)
        return await completion_answer(gen, request, model, body.stream_options)

    @post("/responses", status_code=200)
    async def responses(self, request: Request, svc: Services) -> Response[Any]:
        """OpenAI's Responses API, stateless: one response object, or its events
        (SSE) with ``stream``. Errors: see the module docstring and
        :mod:`service.api.openai.responses_input`."""
        build = partial(responses_request, default_max_tokens=svc.settings.default_max_tokens)
        body, call = await read_call(request, ResponsesRequest, build, "resp", "_")
        try:
            gen, model = await start_generation(svc, body.model, call)
        except ChatTemplateError as exc:
            raise input_error(exc, body) from exc
        return await responses_answer(gen, request, model, body)

    @route("/responses/{response_id:str}", http_method=["GET", "POST", "DELETE"])
    async def stored_response(self, response_id: str) -> None:
        """OpenAI's retrieve, update and delete of a stored response: always 404
        ``response_not_found`` (nothing is stored; the message says so)."""
        raise not_stored(response_id)

    @get("/responses/{response_id:str}/input_items")
    async def stored_response_items(self, response_id: str) -> None:
        """A stored response's input items: 404 ``response_not_found``, as
        :meth:`stored_response`."""
        raise not_stored(response_id)

    @post("/responses/{response_id:str}/cancel")
    async def cancel_response(self, response_id: str) -> None:
        """The cancel of a background response: 404 ``response_not_found``, as
        :meth:`stored_response` (``background`` is refused)."""
        raise not_stored(response_id)
