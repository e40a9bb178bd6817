"""Request and answer bodies of Ollama's API, as msgspec structs.

Shapes follow Ollama's API reference (``docs/api.md`` in its repository). Requests
decode leniently: unknown fields and unknown ``options`` are ignored, as Ollama does.
``stream`` defaults to true, as in Ollama. Durations are integers in nanoseconds and
``created_at`` is RFC 3339 UTC text.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class OllamaOptions(msgspec.Struct, kw_only=True):
    """The ``options`` this server maps onto its own sampling (the rest are accepted and
    ignored): ``num_ctx`` caps the request's context (prompt plus answer), ``num_predict``
    its answer (-1 and -2: the rest of the context; more than the context holds: up to
    its end), ``repeat_penalty`` is ``repetition_penalty``; a negative ``seed`` means
    none."""

    # The integer options take whole-number floats too (``5.0``), as Ollama's JSON does;
    # service.api.ollama.requests.whole checks them.
    num_ctx: int | float | None = None
    num_predict: int | float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | float | None = None
    min_p: float | None = None
    seed: int | float | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class _OllamaCommon(msgspec.Struct, kw_only=True):
    model: str = ""
    options: OllamaOptions | None = None
    stream: bool = True
    format: Any = None
    keep_alive: Any = None
    think: Any = None
    logprobs: bool = False
    top_logprobs: int = 0


class OllamaChatRequest(_OllamaCommon, kw_only=True):
    """``POST /api/chat``: ``messages`` items are ``{"role", "content"}`` objects."""

    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tools: list[Any] | None = None


class OllamaGenerateRequest(_OllamaCommon, kw_only=True):
    """``POST /api/generate``: ``prompt`` through the chat template (with ``system``
    first), or as it is with ``raw``. An empty prompt only checks that the model is
    loaded (``done_reason: "load"``)."""

    prompt: str = ""
    system: str = ""
    raw: bool = False
    suffix: str = ""
    template: str = ""
    context: list[int] | None = None
    images: list[Any] | None = None


class OllamaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An answer's message: ``thinking`` holds a reasoning model's thinking,
    ``tool_calls`` the calls it made (``{"function": {"name", "arguments": {...}}}``,
    arguments an object as in Ollama)."""

    role: str
    content: str
    thinking: str | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class _Done(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The fields of a stream's last line (``done: true``): why it ended, the token
    counts and the durations in nanoseconds; absent from the other lines."""

    done_reason: str | UnsetType = UNSET
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET


class OllamaChatChunk(_Done, kw_only=True, omit_defaults=True):
    """One NDJSON line of ``/api/chat`` (the whole answer when not streaming);
    ``logprobs`` (asked for) those of the tokens its text carries, each ``{"token",
    "logprob", "bytes", "top_logprobs"}``."""

    model: str
    created_at: str
    message: OllamaMessage
    done: bool
    logprobs: list[dict[str, Any]] | UnsetType = UNSET


class OllamaGenerateChunk(_Done, kw_only=True, omit_defaults=True):
    """One NDJSON line of ``/api/generate``: ``response`` text instead of a message."""

    model: str
    created_at: str
    response: str
    done: bool
    thinking: str | UnsetType = UNSET
    logprobs: list[dict[str, Any]] | UnsetType = UNSET


class OllamaDetails(msgspec.Struct, kw_only=True):
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str
    parent_model: str = ""


class OllamaModel(msgspec.Struct, kw_only=True):
    """One entry of ``/api/tags`` (and, with the ``ps`` fields, of ``/api/ps``)."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaDetails
    expires_at: str | UnsetType = UNSET
    size_vram: int | UnsetType = UNSET
    context_length: int | UnsetType = UNSET


class OllamaModelList(msgspec.Struct, kw_only=True):
    models: list[OllamaModel]


class OllamaShowRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # Ollama's older spelling of ``model``
    verbose: bool = False


class OllamaShow(msgspec.Struct, kw_only=True):
    """``POST /api/show``: ``parameters`` are the model's sampling defaults, one
    ``name value`` line each, by Ollama's Modelfile names (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repeat_penalty``), as a Modelfile's ``PARAMETER`` lines; ``template`` is
    the model's chat template (Jinja, not Ollama's Go template)."""

    modelfile: str
    parameters: str
    template: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(msgspec.Struct, kw_only=True):
    version: str


class OllamaError(msgspec.Struct, kw_only=True):
    """Ollama's error body: ``{"error": "message"}`` (also a line of a stream)."""

    error: str
