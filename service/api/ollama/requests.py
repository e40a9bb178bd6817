"""Ollama's bodies as the one :class:`~service.api.request.GenerationRequest` a call
runs as, on the same path as OpenAI's.

Mapped ``options``: ``num_ctx`` (the request's context: prompt plus answer, at most the
engine's; a prompt too long for it, the answer's room kept, is cut as Ollama cuts it:
:mod:`service.api.prompt_fit`), ``num_predict`` (``max_tokens``; -1 and -2: the rest of the context; more than the
context holds: up to its end, as Ollama; unset: ``--default-max-tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``
(negative: none), ``stop``, ``repeat_penalty`` (``repetition_penalty``),
``presence_penalty``, ``frequency_penalty``; their ranges are the OpenAI fields' (one
declaration, :class:`service.api.sampling.Sampling`), and a value outside them is a
400 naming the option, but for a negative ``temperature`` and ``top_p`` 0, which are
greedy as in llama.cpp. Other options (``num_gpu``, ``num_thread``, ``mirostat``...) are
accepted and ignored; ``keep_alive`` is checked as Ollama reads it, and 0 unloads
the model, at once on a call without messages or prompt, else after the answer
(:mod:`service.api.ollama.loading`).
``think`` (true, false, "low", "medium", "high") turns thinking on or off, with a budget
(:mod:`service.api.thinking`; a model that cannot think answers 400 to all but false);
``tools`` work as on ``/v1``
(``tool_choice`` auto); ``format`` (``"json"`` or a JSON schema) is structured output
(:mod:`service.api.structured`); ``logprobs`` and ``top_logprobs`` (0..20) as on
``/v1/chat/completions``. Refused with a 400 rather than dropped: ``images``,
and ``/api/generate``'s ``suffix``, ``template`` and ``context``; and, as Ollama reads
them, a tool message's ``tool_name`` or a past call's ``function.name`` that is no string.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from engine.text.chat import NO_CHAT_TEMPLATE
from service.api.logprobs import check_top_logprobs
from service.api.ollama.schemas import OllamaChatRequest, OllamaGenerateRequest, OllamaOptions
from service.api.openai.messages import json_type
from service.api.prompts import Prompt, chat_prompt
from service.api.request import GenerationRequest, stop_strings
from service.api.sampling import Sampling
from service.api.structured import ollama_format
from service.api.thinking import ollama_thinking, with_thinking
from service.common.errors import INVALID_TYPE, APIError, invalid

# Ollama's option (and Modelfile parameter) names of the sampling fields whose names differ.
OPTION_OF_FIELD = {"repetition_penalty": "repeat_penalty"}
_FIELD_AT = re.compile(r" - at `\$\.(?P<field>\w+)`$")

def _no_images(param: str) -> APIError:
    """The refusal of ``images`` (a chat message's or /api/generate's), naming the field
    in its message: Ollama's error shape carries no ``param``."""
    return invalid(
        f"{param} is not supported: this server serves text models, which take no images; send the text alone",
        param,
    )


def _refuse_unsupported(body: OllamaChatRequest | OllamaGenerateRequest) -> None:
    if isinstance(body, OllamaChatRequest):
        for i, message in enumerate(body.messages):
            if isinstance(message, dict) and message.get("images"):
                raise _no_images(f"messages[{i}].images")
            if isinstance(message, dict):
                _check_arguments(message.get("tool_calls"), f"messages[{i}].tool_calls")
                _check_string(message, "tool_name", f"messages[{i}].tool_name", "the name of the tool whose result "
                              "the message holds")
        return
    if body.images:
        raise _no_images("images")
    for name in ("suffix", "template", "context"):
        if getattr(body, name):
            raise invalid(f"{name} is not supported by this server", name)


def _check_string(parent: dict[str, Any], key: str, param: str, what: str) -> None:
    """``parent[key]``, when sent and not null, is a string, as Ollama reads it.

    Raises:
        APIError: 400 ``invalid_type`` whose message starts with ``param`` (Ollama's
            error shape has no param).
    """
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise invalid(f"{param} must be a string, got {json_type(value)}: {what}", param, INVALID_TYPE)


def _check_arguments(calls: Any, param: str) -> None:
    """A tool call's ``arguments`` is an object in Ollama's API (a JSON text is
    OpenAI's form, which Ollama refuses too), its ``name`` a string.

    Raises:
        APIError: 400 ``<param>[j].function.arguments`` for arguments that are not an
            object, ``<param>[j].function.name`` (``invalid_type``) for a name that is
            no string.
    """
    if not isinstance(calls, list):
        return  # the template check names a malformed list
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            _check_string(function, "name", f"{param}[{j}].function.name", "the name of the function called")
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if arguments is not None and not isinstance(arguments, dict):
            raise invalid(
                f"{param}[{j}].function.arguments must be an object, as Ollama takes it "
                f"({{\"city\": \"Paris\"}}), not {type(arguments).__name__}; send the "
                "arguments as a JSON object, not as JSON text",
                f"{param}[{j}].function.arguments",
            )


def _messages(body: OllamaChatRequest) -> list[dict[str, Any]]:
    """Ollama's messages as the template takes them: role, content, tool calls and
    ``thinking`` (the template decides whether earlier reasoning is shown again:
    :mod:`engine.text.chat`)."""
    out = []
    for message in body.messages:
        if not isinstance(message, dict):
            out.append(message)  # the template check names it
            continue
        # A message without content is refused as one with ``"content": null`` is
        # (the template check names it), but an assistant turn that only called tools.
        entry = {"role": message.get("role"), "content": message.get("content")}
        if message.get("tool_calls"):
            entry["tool_calls"] = message["tool_calls"]
        if message.get("thinking"):
            entry["thinking"] = message["thinking"]
        if isinstance(message.get("tool_name"), str):
            entry["name"] = message["tool_name"]
        out.append(entry)
    return out


def whole(value: int | float | None, option: str) -> int | None:
    """An integer option as Ollama's JSON gives it: an int, or a float with no fraction
    (``5.0``).

    Raises:
        APIError: 400 ``options.<option>`` for a fraction, NaN or an infinity.
    """
    if value is None or isinstance(value, int):
        return value
    if not math.isfinite(value) or value != int(value):
        raise invalid(f"options.{option} must be a whole number, got {value}", f"options.{option}")
    return int(value)


def _sampling(o: OllamaOptions) -> Sampling:
    """The sampling fields of ``options``, in their declared ranges. As llama.cpp's
    sampler takes them (and so Ollama), a negative ``temperature`` and a ``top_p`` of 0
    (which keeps only the likeliest token) are greedy: temperature 0 (the OpenAI routes
    keep refusing both).

    Raises:
        APIError: 400 ``options.<name>`` for a value out of its range.
    """
    greedy = (o.temperature is not None and o.temperature < 0) or o.top_p == 0
    fields: dict[str, Any] = {
        "temperature": 0.0 if greedy else o.temperature,
        "top_p": None if o.top_p == 0 else o.top_p,
        "top_k": whole(o.top_k, "top_k"),
        "min_p": o.min_p,
        "seed": seed if (seed := whole(o.seed, "seed")) is not None and seed >= 0 else None,
        "repetition_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
    }
    try:
        return msgspec.convert(fields, type=Sampling)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _FIELD_AT.search(text)
        field = match.group("field") if match else ""
        option = "options." + OPTION_OF_FIELD.get(field, field)
        raise invalid(f"{option}: {text[: match.start()] if match else text}", option) from None


def _request(
    body: OllamaChatRequest | OllamaGenerateRequest,
    request_id: str,
    started: float,
    default_max_tokens: int,
    prompt: Prompt,
    tools: list[Any] | None = None,
    thinking: tuple[bool | None, int | None] = (None, None),
) -> GenerationRequest:
    """What both calls map alike: ``options``, ``format``, ``stream``, ``logprobs``;
    ``thinking``: ``think`` as :func:`service.api.thinking.ollama_thinking` reads it.

    Raises:
        APIError: 400 naming the option or field out of range (``top_logprobs`` beyond
            0..20, or without ``logprobs``).
    """
    o = body.options or OllamaOptions()
    num_ctx, num_predict = whole(o.num_ctx, "num_ctx"), whole(o.num_predict, "num_predict")
    if num_ctx is not None and num_ctx < 1:
        raise invalid(f"num_ctx must be at least 1, got {num_ctx}", "options.num_ctx")
    max_tokens = None
    if num_predict is not None:
        if num_predict < 0:
            default_max_tokens = 0  # -1 (no limit) and -2 (fill the context)
        elif num_predict == 0:
            max_tokens = 0
        else:
            # A limit, not a demand: as Ollama, more than the context holds generates up
            # to its end (done_reason "length") rather than refusing the call.
            default_max_tokens = num_predict
    json_schema = ollama_format(body.format)
    stop = stop_strings(o.stop, "options.stop")
    check_top_logprobs(body.top_logprobs, body.logprobs)
    return GenerationRequest(
        request_id=request_id,
        started=started,
        prompts=(prompt,),
        sampling=_sampling(o),
        max_tokens=max_tokens,
        max_tokens_param="num_predict",
        default_max_tokens=default_max_tokens or None,
        stop=tuple(stop),
        json_schema=json_schema,
        schema_param="format",
        chat=True,
        tools=tools,
        context_tokens=num_ctx,
        truncate=True,
        context_param="num_ctx",
        stream=body.stream,
        thinking=thinking[0],
        thinking_budget=thinking[1],
        thinking_param="think",
        logprobs=body.top_logprobs if body.logprobs else None,
    )


def chat_request(
    body: OllamaChatRequest, request_id: str, started: float, default_max_tokens: int
) -> GenerationRequest:
    """``/api/chat``'s body as the request it runs as.

    Args:
        default_max_tokens: ``--default-max-tokens`` (0: the rest of the context).

    Raises:
        APIError: 400 naming the field (``options.temperature``, ``format``...).
    """
    _refuse_unsupported(body)
    tools = body.tools or None
    thinking = ollama_thinking(body.think)
    (prompt,) = chat_prompt(_messages(body), tools, with_thinking(None, thinking[0], body.think))
    return _request(body, request_id, started, default_max_tokens, prompt, tools, thinking)


def generate_request(
    body: OllamaGenerateRequest, request_id: str, started: float, default_max_tokens: int
) -> GenerationRequest:
    """``/api/generate``'s body as a chat of a ``system`` message (when set) and a
    ``user`` message, or with ``raw``, its prompt tokenized as is (on a model without
    a chat template: :func:`untemplated_generate`).

    Raises:
        APIError: 400 naming the field.
    """
    _refuse_unsupported(body)
    thinking = ollama_thinking(body.think)
    if body.raw:
        prompt = Prompt("prompt", text=body.prompt)
    else:
        messages = [{"role": "system", "content": body.system}] if body.system else []
        messages.append({"role": "user", "content": body.prompt})
        (prompt,) = chat_prompt(messages, None, with_thinking(None, thinking[0], body.think))
    return _request(body, request_id, started, default_max_tokens, prompt, None, thinking)


def untemplated_generate(body: OllamaGenerateRequest) -> Callable[[GenerationRequest], GenerationRequest]:
    """What ``/api/generate``'s request becomes on a model whose tokenizer has no chat
    template: its prompt passed as is, as Ollama passes it through a model without a
    template, ``system`` (when set) before it with a blank line between (Ollama's
    fallback template would drop it; with ``raw``, the prompt alone, as on any model)."""
    text = f"{body.system}\n\n{body.prompt}" if body.system and not body.raw else body.prompt
    return lambda request: replace(request, prompts=(Prompt("prompt", text=text),))


def untemplated_chat(request: GenerationRequest) -> GenerationRequest:
    """``/api/chat`` on a model whose tokenizer has no chat template: refused, naming
    the call that serves it.

    Raises:
        APIError: 400 ``messages``.
    """
    raise invalid(
        f"{NO_CHAT_TEMPLATE}: use /api/generate, whose prompt such a model takes as is (or /v1/completions)",
        "messages",
    )
