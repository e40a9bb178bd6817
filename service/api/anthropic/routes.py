"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``,
as Claude Code and Anthropic's SDKs call them.

Generation runs on the path of the other APIs: the body decoded
(:mod:`service.api.anthropic.schemas`), one
:class:`~service.api.request.GenerationRequest` built from it
(:mod:`service.api.anthropic.requests`), readiness and the model checked, the shared
runner (:meth:`service.api.generation.Generation.start`), then Anthropic's answer
(:mod:`service.api.anthropic.answers`). So admission, the context checks, the
supervisor's restarts and retries, ``--request-timeout`` and client disconnects behave as
on the other routes. ``thinking`` of type ``enabled`` on a model whose chat template
writes no thinking blocks is a 400, after the model check. ``count_tokens`` renders the
prompt as ``/v1/messages`` does (system, tools, messages, a forced call's opening) and
counts its tokens, whatever the context holds; nothing runs in the engine, so it
answers while the engine is paused or unloaded too (the tokenizer stays in the
service; :meth:`~service.api.services.Services.tokenizer_info`).

Errors are Anthropic's (:mod:`service.api.anthropic.errors`). The ``anthropic-version``
and ``anthropic-beta`` headers are accepted and not read. With ``--api-key`` these
routes need it, as ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (the guard is
added where the app is built, :func:`service.http.app.create_app`).
"""

from __future__ import annotations

import sys
from typing import Any

from litestar import Controller, Request, Response, post

from engine.text.chat import ChatTemplateError
from service.api.anthropic.answers import message_answer
from service.api.anthropic.errors import ANTHROPIC_EXCEPTION_HANDLERS, ANTHROPIC_PATH
from service.api.anthropic.requests import (
    count_request,
    messages_request,
    template_error,
    thinking_asked,
)
from service.api.anthropic.schemas import CountTokensRequest, MessagesRequest, TokenCount
from service.api.chat_plan import chat_template
from service.api.generation import prompt_ids
from service.api.reasoning import template_thinks
from service.api.request import read_call
from service.api.responses import json_response
from service.api.services import Services
from service.api.start import start_generation
from service.common.errors import invalid

_ID_PREFIX = "msg"


async def _check_thinking(svc: Services, body: CountTokensRequest) -> None:
    """Thinking asked of a model that cannot think: 400 (after readiness and the model's
    name, as the generation's other checks).

    Raises:
        APIError: 503/404 as :func:`~service.api.generation.start_generation`; 400
            ``thinking``.
    """
    if not thinking_asked(body):
        return
    info = await svc.supervisor.ready()
    svc.check_model(body.model, info)
    _refuse_thinking(svc, body)


def _refuse_thinking(svc: Services, body: CountTokensRequest) -> None:
    """400 ``thinking`` when the body asks a model whose template cannot think to."""
    assert svc.text is not None
    if thinking_asked(body) and not template_thinks(chat_template(svc.text)):
        raise invalid(
            "this model cannot think (its chat template writes no thinking blocks); "
            "leave thinking out or send {'type': 'disabled'}",
            "thinking",
        )


class AnthropicController(Controller):
    """Anthropic's Messages API under ``/v1/messages`` (see the module docstring)."""

    path = ANTHROPIC_PATH
    exception_handlers = ANTHROPIC_EXCEPTION_HANDLERS

    @post("/", status_code=200)
    async def messages(self, request: Request, svc: Services) -> Response[Any]:
        """A message, streamed as Server-Sent Events when ``stream`` is true. Its
        ``model`` is the name the request used, as Anthropic echoes it (any name the
        served model answers to; the served model's first name when the body's is empty)."""
        body, call = await read_call(request, MessagesRequest, messages_request, _ID_PREFIX)
        await _check_thinking(svc, body)
        try:
            gen, model = await start_generation(svc, body.model, call)
        except ChatTemplateError as exc:
            raise template_error(exc, body) from exc
        return await message_answer(gen, request, body.model or model)

    @post("/count_tokens", status_code=200)
    async def count_tokens(self, request: Request, svc: Services) -> Response[bytes]:
        """The tokens of the prompt a messages request with these parts would have."""
        body, call = await read_call(request, CountTokensRequest, count_request, _ID_PREFIX)
        info = await svc.tokenizer_info()
        svc.check_model(body.model, info)
        _refuse_thinking(svc, body)  # as /v1/messages refuses it
        assert svc.text is not None
        try:
            _, prompts = await prompt_ids(svc.text, info, call, sys.maxsize)
        except ChatTemplateError as exc:
            raise template_error(exc, body) from exc
        return json_response(TokenCount(input_tokens=len(prompts[0])))
