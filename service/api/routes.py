"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``.

Bodies are decoded here (not by Litestar's signature model) so that every defect
in them, empty, not JSON, not an object, a wrong type, answers OpenAI's 400 with
``param``. Order of checks: body, then fields needing nothing else, then readiness
(503), model (404); then the checked call goes into the engine in one part
(:meth:`service.api.generation.Generation.start`; a chat's through
:func:`service.api.chat_generation.start_chat`): admission (503 ``queue_full``, see
:mod:`service.api.admission`), ``logit_bias`` against the vocabulary (400), a chat's
``response_format`` and ``tools``/``tool_choice`` (400), a cheap lower bound on the
prompt's tokens against the context (400 ``context_length_exceeded`` before any tokenizing, see
:meth:`service.api.text.TextSide.min_tokens`), tokenizing (in threads; 400 for a template
refusal), context (400), submit. With ``--request-timeout``, a request still running
that many seconds after it arrived is aborted in the engine and answered 504
``request_timeout`` (in a stream: an error event, then ``[DONE]``).

Authentication (``--api-key``) is not here but in the guard of the router these
routes are mounted on (:class:`service.common.auth.BearerGuard`). The checks that need
no tokenizer are in :mod:`service.api.checks`; how a generation becomes its answer,
JSON or Server-Sent Events, in :mod:`service.api.responses`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from litestar import Controller, Request, Response, get, post

from engine.wire.messages import EngineInfo
from service.api.chat_generation import call_generation, start_chat
from service.api.checks import check_chat_fields, completion_prompts
from service.common.errors import decode_body
from service.api.generation import Generation, MaxTokens, check_common
from service.api.logprobs import TokenTexts
from service.api.prompts import completion_prompts_of
from service.api.responses import event_stream, first_piece_held, json_response, respond
from service.api.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    TextChoice,
)
from service.api.structured import response_schema
from service.api.services import Services

T = TypeVar("T")
R = TypeVar("R")


async def _checked(
    request: Request, svc: Services, body_type: type[T], check: Callable[[T], R]
) -> tuple[T, R, EngineInfo, str]:
    """What every generation call checks first, in this order (so the errors come in
    it): decode the body into ``body_type`` (400), the checks common to both calls, then
    ``check(req)`` (400; its result is returned), a ready worker (503) and the model name
    (404).

    Returns:
        ``(req, check's result, the engine's facts, the model name to answer with)``.
    """
    req = decode_body(await request.body(), body_type)
    check_common(req)  # type: ignore[arg-type]
    checked = check(req)
    info = await svc.supervisor.ready()
    model = svc.check_model(req.model, info)  # type: ignore[attr-defined]
    return req, checked, info, model


@dataclass
class _TextShaper:
    """A text completion's choices, whole or streamed: ``echo`` puts each prompt's text
    first (in a stream, in the sequence's first chunk), and ``logprobs`` adds OpenAI's
    legacy logprobs object (with ``echo``, the prompt's tokens first).

    Args:
        gen: the started generation (``n`` sequences per prompt).
        echoes: each prompt's text when ``echo`` is set, else None.
        tokens: the tokenizer's token texts when ``logprobs`` is set, else None.
    """

    gen: Generation
    echoes: list[str] | None
    tokens: TokenTexts | None
    _started: set[int] = field(default_factory=set)
    _offsets: dict[int, int] = field(default_factory=dict)

    def _head(self, index: int) -> str:
        if index in self._started:
            return ""
        self._started.add(index)
        return self.echoes[index // self.gen.n] if self.echoes is not None else ""

    def _logprobs(self, index: int) -> dict | None:
        if self.tokens is None:
            return None
        pairs: list = []
        if index not in self._offsets and self.echoes is not None:
            scored = self.gen.prompt_logprobs(index)
            if scored is not None:
                pairs += zip(self.gen.prompts[index // self.gen.n], scored, strict=True)
        pairs += [(r.token_id, r) for r in self.gen.take_logprobs(index)]
        body, self._offsets[index] = self.tokens.legacy(pairs, self._offsets.get(index, 0))
        return body

    def choices(self, texts: list[str], reasons: list[str | None]) -> list[TextChoice]:
        """The choices of a whole text completion, one per sequence."""
        return [self.piece(i, text, reasons[i], None) for i, text in enumerate(texts)]

    def piece(self, index: int, text: str, reason: str | None, _role: str | None) -> TextChoice:
        """The one choice of a text stream's chunk (text completions have no roles)."""
        return TextChoice(
            index=index, text=self._head(index) + text, finish_reason=reason, logprobs=self._logprobs(index)
        )


def _card(svc: Services, info, name: str) -> ModelCard:
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

    @get("/models")
    async def models(self, svc: Services) -> Response[bytes]:
        """The served model. ``context_length`` (and ``max_model_len``) is the context
        one request can use *now*, prompt plus completion in tokens: the live limit,
        which follows the KV pool as it shrinks and grows (a request longer than it
        is refused with ``context_length_exceeded``). ``model_context_length`` is the
        model's own. 503 before the first worker is ready."""
        # The last worker's facts stay valid while it restarts; before the first one
        # is ready, check_ready raises NotReady (503).
        info = svc.supervisor.info or svc.supervisor.check_ready()
        return json_response(ModelList(data=[_card(svc, info, name) for name in svc.model_names(info)]))

    @get("/models/{model_id:path}")
    async def model(self, model_id: str, svc: Services) -> Response[bytes]:
        """One served model by a name :meth:`models` lists (OpenAI's retrieve; a name
        with slashes, as a Hugging Face id, included); 404 ``model_not_found`` for any
        other name, 503 before the first worker is ready."""
        info = svc.supervisor.info or svc.supervisor.check_ready()
        name = model_id.lstrip("/")
        # check_model takes an empty name for the served model, a retrieve does not.
        if name not in svc.model_names(info):
            svc.check_model(name or " ", info)  # raises the 404 naming the served models
        return json_response(_card(svc, info, name))

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, svc: Services) -> Response[Any]:
        """Chat completion, streaming (SSE) or not. Errors: see the module docstring."""
        started = time.perf_counter()
        req, _, info, model = await _checked(request, svc, ChatCompletionRequest, check_chat_fields)
        gen, output = await start_chat(req, info, svc, started, f"chatcmpl-{uuid.uuid4().hex}")
        created = int(time.time())
        assert svc.text is not None
        tokens = svc.text.token_texts if req.logprobs else None

        def logprobs(index: int) -> dict | None:
            return None if tokens is None else tokens.chat(gen.take_logprobs(index))

        if not req.stream:

            def choices(texts: list[str], reasons: list[str | None]) -> list[ChatChoice]:
                shaped = [output.message(text, reasons[i]) for i, text in enumerate(texts)]
                return [
                    ChatChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs(i))
                    for i, (message, reason) in enumerate(shaped)
                ]

            return await respond(gen, request, ChatCompletion, choices, created, model)

        def deltas(index: int, text: str, reason: str | None, role: str | None) -> list[ChatChunkChoice]:
            made = output.deltas(index, text, reason, role)
            if tokens is not None and role is None:
                # The tokens that arrived since the last chunk go with this piece's first.
                records = gen.take_logprobs(index)
                if records:
                    if not made:
                        made = [ChatChunkChoice(index=index, delta=Delta())]
                    made[0].logprobs = tokens.chat(records)
            return made

        # A constrained answer's schema compiles in the engine: its first bytes wait for
        # the engine, so a schema it refuses is a 400, as without stream.
        held = await first_piece_held(gen) if response_schema(req.response_format) is not None else None
        return event_stream(
            gen, req.stream_options, ChatCompletionChunk, deltas, created, model, roles=req.n, pieces=held
        )

    @post("/completions", status_code=200)
    async def completions(self, request: Request, svc: Services) -> Response[Any]:
        """Text completion of a raw prompt (no chat template), streaming or not."""
        started = time.perf_counter()
        req, items, info, model = await _checked(
            request, svc, CompletionRequest, completion_prompts
        )
        gen = call_generation(svc, f"cmpl-{uuid.uuid4().hex}", req, started)
        # An unset max_tokens is OpenAI's 16 for text completions.
        max_tokens = MaxTokens(req.max_tokens, "max_tokens", "prompt", default=16)
        await gen.start(svc.admission, info, req, completion_prompts_of(items), max_tokens)
        created = int(time.time())
        assert svc.text is not None
        echoes = None
        if req.echo:
            echoes = [p if isinstance(p, str) else svc.text.tokenizer.decode(p) for p in items]
        shaper = _TextShaper(gen, echoes, None if req.logprobs is None else svc.text.token_texts)

        if not req.stream:
            return await respond(gen, request, Completion, shaper.choices, created, model)
        return event_stream(gen, req.stream_options, CompletionChunk, shaper.piece, created, model)
