"""Request and response bodies of the OpenAI-compatible API, as msgspec structs.

Requests decode leniently where OpenAI's clients expect it: unknown fields are
ignored (new client versions send new fields). Fields we cannot honour are declared
so that setting them is refused with a 400 naming the field rather than silently
ignored (``functions``, ``suffix``, ``best_of`` other than ``n``, ``modalities`` other
than text, ``audio``); their neutral values are accepted. ``logprobs``/``top_logprobs``
(0..20) and a completion's ``echo`` are shaped by :mod:`service.api.logprobs`. ``response_format`` is structured output
(:mod:`service.api.structured`). ``tools``/``tool_choice`` are served by :mod:`service.api.tools`,
``chat_template_kwargs`` reach the template, and answers carry ``reasoning_content``
(:mod:`service.api.reasoning`). ``logit_bias`` ids are checked against the vocabulary.
Extensions beyond OpenAI, as vLLM names them: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``.

Integer and number ranges are declared on the fields (``msgspec.Meta``; the sampling
ones on :class:`service.api.sampling.Sampling`, which the bodies inherit), so decoding
refuses a value outside them with a 400 naming the field, and the OpenAPI document
(:mod:`service.api.openapi`) states them: ``seed`` 0..2**63-1, ``n`` 1..128, ``top_k``
-1..2**31-1, ``max_tokens`` from 0 (its upper bound is the context, checked with the
prompt), ``temperature`` 0..2, ``top_p`` (0..1], ``min_p`` 0..1, penalties -2..2.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from service.api.sampling import Sampling
from service.common.ranges import MAX_TOKENS_MIN

MAX_N = 128
# Sequences one call runs (a text completion's prompts times n): OpenAI's bound on n.
MAX_SEQUENCES = MAX_N

TokenCount = Annotated[int, Meta(ge=MAX_TOKENS_MIN)]
N = Annotated[int, Meta(ge=1, le=MAX_N)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(Sampling, kw_only=True):
    """Fields shared by chat and text completions (the sampling ones, and their
    ranges, are :class:`service.api.sampling.Sampling`'s)."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    stop: str | list[str] | None = None
    n: N = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. ``messages`` items are ``{"role", "content"}``
    objects; content is a string or a list of ``{"type": "text", "text"}`` parts.
    ``max_completion_tokens`` wins over ``max_tokens``; both absent (or null) mean
    ``--default-max-tokens``. ``chat_template_kwargs`` (e.g. ``{"enable_thinking":
    false}``) are passed to the chat template. ``reasoning_effort`` (none, minimal,
    low, medium, high) turns a thinking model's thinking off or on with a budget;
    ``thinking_budget`` (an extension) sets that budget in tokens
    (:mod:`service.api.thinking`)."""

    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    thinking_budget: Annotated[int, Meta(ge=0)] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of
    token ids or a list of those; each prompt yields ``n`` choices. ``max_tokens``
    defaults to 16, as OpenAI's does. ``response_format`` (vLLM's extension)
    constrains the text as on chat completions."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None


class ErrorObject(msgspec.Struct, kw_only=True):
    """OpenAI's error object: ``param`` names the request field at fault, ``code`` is
    machine-readable (``context_length_exceeded``, ``invalid_api_key``...)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error the HTTP surface answers: ``{"error": {...}}``."""

    error: ErrorObject


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(msgspec.Struct, kw_only=True):
    """The answer. ``reasoning_content``: a reasoning model's thinking (absent for
    other models); ``tool_calls``: the calls the model made (absent when none)."""

    role: str
    content: str | None
    reasoning_content: str | None | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class _Choice(msgspec.Struct, kw_only=True):
    """What every choice starts with: its index among the call's sequences."""

    index: int


class ChatChoice(_Choice, kw_only=True):
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class _Answer(msgspec.Struct, kw_only=True):
    """The fields every completion body and stream chunk starts with: the call's id,
    its Unix time and the model that answered."""

    id: str
    created: int
    model: str


class ChatCompletion(_Answer, kw_only=True):
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_Choice, kw_only=True):
    delta: Delta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(_Answer, kw_only=True):
    """One SSE event of a chat stream. ``usage`` is absent unless the client asked for
    it (``stream_options.include_usage``): then null on every chunk but the last."""

    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class TextChoice(_Choice, kw_only=True):
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class Completion(_Answer, kw_only=True):
    choices: list[TextChoice]
    usage: Usage
    object: str = "text_completion"


class CompletionChunk(_Answer, kw_only=True):
    choices: list[TextChoice]
    object: str = "text_completion"
    usage: Usage | None | UnsetType = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    """One served model. ``context_length`` is what one request can really use (prompt
    plus completion, in tokens): the smaller of the model's own context and what the
    KV pool holds; ``model_context_length`` is the model's own."""

    id: str
    created: int
    context_length: int
    max_model_len: int
    model_context_length: int
    object: str = "model"
    owned_by: str = "headroom"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"
