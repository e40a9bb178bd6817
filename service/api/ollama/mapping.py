"""Ollama's requests onto the OpenAI request this server runs, and the model's facts
into Ollama's ``details``.

Mapped ``options``: ``num_ctx`` (the request's context: prompt plus answer, at most the
engine's), ``num_predict`` (``max_tokens``; -1 and -2: the rest of the context; unset:
``--default-max-tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``
(negative: none), ``stop``, ``repeat_penalty`` (``repetition_penalty``),
``presence_penalty``, ``frequency_penalty``. Other options (``num_gpu``, ``num_thread``,
``mirostat``...) and ``keep_alive`` (the model stays loaded while the server runs) are
accepted and ignored. ``think`` is the template's ``enable_thinking``; ``tools`` work
as on ``/v1`` (``tool_choice`` auto); ``format`` (``"json"`` or a JSON schema) is
structured output (:mod:`service.api.structured`). Refused with a 400 rather than
dropped: ``images``, and ``/api/generate``'s ``suffix``, ``template`` and ``context``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.wire.messages import EngineInfo
from service.common.errors import APIError, invalid
from service.api.generation import check_common
from service.api.ollama.schemas import (
    OllamaChatRequest,
    OllamaDetails,
    OllamaGenerateRequest,
    OllamaOptions,
)
from service.api.schemas import ChatCompletionRequest
from service.api.structured import ollama_format

# Ollama's option names for the OpenAI fields they become (for errors naming them).
_OPTION_OF_FIELD = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repetition_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_tokens": "num_predict",
}
_TAG = ":latest"


@dataclass(frozen=True)
class Mapped:
    """An Ollama request as this server runs it: the OpenAI request, the context cap
    (``num_ctx``, None: the engine's) and the default answer length (None:
    ``--default-max-tokens``; 0: the rest of the context)."""

    request: ChatCompletionRequest
    context_tokens: int | None
    default_max_tokens: int | None


def model_name(name: str) -> str:
    """Ollama's ``name:latest`` is ``name``: clients add the tag to names without one."""
    return name[: -len(_TAG)] if name.endswith(_TAG) else name


def _refuse_unsupported(body: OllamaChatRequest | OllamaGenerateRequest) -> None:
    if isinstance(body, OllamaChatRequest):
        for i, message in enumerate(body.messages):
            if isinstance(message, dict) and message.get("images"):
                raise invalid(
                    "images are not supported: this server serves text models",
                    f"messages[{i}].images",
                )
        return
    for name in ("suffix", "template", "context", "images"):
        if getattr(body, name):
            raise invalid(f"{name} is not supported by this server", name)


def _messages(body: OllamaChatRequest) -> list[dict[str, Any]]:
    """Ollama's messages as the template takes them: role and content (Ollama's
    ``thinking`` of earlier answers is not sent back to the model, as Ollama does)."""
    out = []
    for message in body.messages:
        if not isinstance(message, dict):
            out.append(message)  # the template check names it
            continue
        entry = {"role": message.get("role"), "content": message.get("content", "")}
        if message.get("tool_calls"):
            entry["tool_calls"] = message["tool_calls"]
        if isinstance(message.get("tool_name"), str):
            entry["name"] = message["tool_name"]
        out.append(entry)
    return out


def _thinking(body: OllamaChatRequest | OllamaGenerateRequest) -> dict[str, Any] | None:
    """Ollama's ``think`` as the template's ``enable_thinking`` (``"high"``... count as
    on)."""
    return None if body.think is None else {"enable_thinking": bool(body.think)}


def _sampling(options: OllamaOptions | None) -> tuple[dict[str, Any], int | None, int | None]:
    """The OpenAI sampling fields of ``options``, the context cap and the default
    answer length (see :class:`Mapped`)."""
    o = options or OllamaOptions()
    fields: dict[str, Any] = {
        "temperature": o.temperature,
        "top_p": o.top_p,
        "top_k": o.top_k,
        "min_p": o.min_p,
        "stop": o.stop,
        "repetition_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
    }
    if o.seed is not None and o.seed >= 0:
        fields["seed"] = o.seed
    default_max = None
    if o.num_predict is not None:
        if o.num_predict < 0:
            default_max = 0  # -1 (no limit) and -2 (fill the context)
        else:
            fields["max_tokens"] = o.num_predict
    if o.num_ctx is not None and o.num_ctx < 1:
        raise invalid(f"num_ctx must be at least 1, got {o.num_ctx}", "options.num_ctx")
    return fields, o.num_ctx, default_max


def _check(req: ChatCompletionRequest) -> None:
    """The OpenAI checks, with errors naming Ollama's option."""
    try:
        check_common(req)
    except APIError as exc:
        if exc.param in _OPTION_OF_FIELD:
            exc.param = "options." + _OPTION_OF_FIELD[exc.param]
        raise


def chat_request(body: OllamaChatRequest) -> Mapped:
    """``/api/chat``'s body as the OpenAI chat request it runs as.

    Raises:
        APIError: 400 naming the field (``options.temperature``, ``format``...).
    """
    _refuse_unsupported(body)
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    fields, context, default_max = _sampling(body.options)
    req = ChatCompletionRequest(
        model=model_name(body.model),
        messages=_messages(body),
        tools=body.tools or None,
        chat_template_kwargs=_thinking(body),
        response_format=ollama_format(body.format),
        **fields,
    )
    _check(req)
    return Mapped(req, context, default_max)


def generate_request(body: OllamaGenerateRequest) -> Mapped:
    """``/api/generate``'s body as a chat request of a ``system`` message (when set)
    and a ``user`` message; with ``raw`` the caller tokenizes ``prompt`` itself.

    Raises:
        APIError: 400 naming the field.
    """
    _refuse_unsupported(body)
    fields, context, default_max = _sampling(body.options)
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.prompt})
    req = ChatCompletionRequest(
        model=model_name(body.model),
        messages=messages,
        chat_template_kwargs=_thinking(body),
        response_format=ollama_format(body.format),
        **fields,
    )
    _check(req)
    return Mapped(req, context, default_max)


_BYTES_PER_PARAMETER = {"float32": 4, "float16": 2, "bfloat16": 2}


def details(info: EngineInfo) -> OllamaDetails:
    """Ollama's ``details`` of the served model: family from the architecture
    (``LlamaForCausalLM`` -> ``llama``), the parameter count (``135M``), and as the
    format and quantization level the GGUF block type the weights are held in
    (``gguf``, ``Q4_1``) or, when they are held dequantized, their dtype."""
    family = info.architecture.lower().removesuffix("forcausallm") or info.architecture
    count = info.parameter_count
    if not count:  # an engine that does not count them (tests' fake): from the dense bytes
        per = _BYTES_PER_PARAMETER.get(info.dtype.removeprefix("torch."), 0)
        count = info.weight_bytes // per if per and not info.weight_format else 0
    if count >= 10**9:
        size = f"{count / 10**9:.1f}B"
    elif count:
        size = f"{round(count / 10**6)}M"
    else:
        size = "unknown"
    return OllamaDetails(
        format="gguf" if info.weight_format else "safetensors",
        family=family,
        families=[family],
        parameter_size=size,
        quantization_level=info.weight_format or info.dtype.removeprefix("torch.").upper(),
    )
