"""Request and response bodies of the OpenAI-compatible API, as msgspec structs.

Requests decode leniently where OpenAI's clients expect it: unknown fields are
ignored (new client versions send new fields). Fields we cannot honour are declared
so that setting them is refused with a 400 naming the field rather than silently
ignored (``logprobs``, ``tools``, ``response_format`` other than text, ``logit_bias``,
``echo``, ``suffix``, ``best_of`` above ``n``); their neutral values are accepted.
Extensions beyond OpenAI, as vLLM names them: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. ``messages`` items are ``{"role", "content"}``
    objects; content is a string or a list of ``{"type": "text", "text"}`` parts.
    ``max_completion_tokens`` wins over ``max_tokens``; both absent (or null) mean
    "up to the rest of the context"."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of
    token ids or a list of those; each prompt yields ``n`` choices. ``max_tokens``
    defaults to 16, as OpenAI's does."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE event of a chat stream. ``usage`` is absent unless the client asked for
    it (``stream_options.include_usage``): then null on every chunk but the last."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    object: str = "text_completion"


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
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
