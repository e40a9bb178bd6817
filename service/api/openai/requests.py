"""OpenAI's bodies as the one :class:`~service.api.request.GenerationRequest` a call
runs as, with the checks that need neither the tokenizer nor the engine: fields this
server refuses rather than ignores, OpenAI's four prompt forms, ``stop``,
``logit_bias``'s form and ``response_format``.

The body's shape and declared ranges were checked when it was decoded
(:mod:`service.api.openai.schemas`); each refusal here is a 400 naming the field
(:func:`service.common.errors.invalid`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from service.api.logprobs import check_logprobs_count, check_top_logprobs
from service.api.openai.messages import check_messages
from service.api.openai.schemas import MAX_SEQUENCES, ChatCompletionRequest, CompletionRequest
from service.api.prompts import chat_prompt, completion_prompts_of
from service.api.request import GenerationRequest, stop_strings
from service.api.sampling import logit_bias_pairs, sampling_of
from service.api.structured import response_schema
from service.api.thinking import budget_thinking, effort_thinking, with_thinking
from service.api.tool_checks import (
    OPENAI_HISTORY,
    Turn,
    check_call_arguments,
    check_tool_history,
    check_tool_name,
)
from service.common.errors import INVALID_TYPE, invalid

# An unset max_tokens is OpenAI's 16 for text completions.
COMPLETION_MAX_TOKENS = 16


def chat_request(
    body: ChatCompletionRequest, request_id: str, started: float, default_max_tokens: int
) -> GenerationRequest:
    """A chat completion's body as the request it runs as.

    Args:
        default_max_tokens: ``--default-max-tokens``, the length when the body sets
            none of ``max_completion_tokens`` and ``max_tokens`` (0: the rest of the
            context).

    Raises:
        APIError: 400 naming the field (``stream_options`` without ``stream``, ``top_logprobs``, ``functions``,
            ``modalities`` other than text, ``audio``, ``response_format``, ``stop``, ``logit_bias``, ``reasoning_effort``;
            ``thinking_budget`` when it contradicts ``reasoning_effort``;
            ``messages[i]``'s fields missing or of the wrong type, or a content that
            is an empty array, as OpenAI refuses it
            (:func:`~service.api.openai.messages.check_messages`);
            ``tools[i].function.name`` for a name OpenAI refuses:
            :func:`~service.api.tool_checks.check_tool_name`; ``messages[i]`` and its
            ``tool_calls[j]`` for a tool history OpenAI refuses: :func:`_check_tool_history`).
    """
    logit_bias, stop = logit_bias_pairs(body.logit_bias), stop_strings(body.stop)
    check_stream_options(body.stream_options, body.stream)
    check_top_logprobs(body.top_logprobs, body.logprobs)
    # The deprecated form of tools (tools themselves: service.api.tools); their neutral
    # values (no functions, function_call "none" or "auto") ask for nothing.
    if body.functions:
        raise invalid("functions are not supported; send tools instead", "functions")
    if body.function_call not in (None, "none", "auto"):
        raise invalid("function_call is not supported; send tools and tool_choice instead", "function_call")
    _check_text_output(body.modalities, body.audio)
    check_messages(body.messages)
    _check_tool_history(body.messages)
    for i, tool in enumerate(body.tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        check_tool_name(function.get("name") if isinstance(function, dict) else None, f"tools[{i}].function.name")
    json_schema = response_schema(body.response_format)
    thinking, budget = effort_thinking(body.reasoning_effort, "reasoning_effort")
    if body.thinking_budget is not None:
        thinking, budget = budget_thinking(thinking, body.thinking_budget, "reasoning_effort", "thinking_budget")
    if body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = body.max_tokens, "max_tokens"
    return GenerationRequest(
        request_id=request_id,
        started=started,
        prompts=tuple(
            chat_prompt(
                body.messages, body.tools or None, with_thinking(body.chat_template_kwargs, thinking, body.reasoning_effort)
            )
        ),
        sampling=sampling_of(body),
        n=body.n,
        max_tokens=max_tokens,
        max_tokens_param=param,
        default_max_tokens=default_max_tokens or None,
        stop=tuple(stop),
        logit_bias=logit_bias,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        json_schema=json_schema,
        chat=True,
        tools=body.tools,
        tool_choice=body.tool_choice,
        stream=body.stream,
        thinking=thinking,
        thinking_budget=budget,
        thinking_param="thinking_budget" if body.reasoning_effort is None else "reasoning_effort",
    )


def _check_text_output(modalities: list[str] | None, audio: dict[str, Any] | None) -> None:
    """Answers are text only: ``modalities`` asking for anything else (``audio``), or
    ``audio`` output settings, are refused as OpenAI refuses them on a model without
    audio output, rather than answered in text unsaid (``["text"]`` asks for what is
    served).

    Raises:
        APIError: 400 ``modalities`` or ``audio``.
    """
    other = [m for m in modalities or () if m != "text"]
    if other:
        raise invalid(
            f"modalities asks for {', '.join(map(repr, other))} output, which this model does not give: "
            "it answers in text only; send [\"text\"] or leave modalities out",
            "modalities",
        )
    if audio is not None:
        raise invalid("audio output is not supported: this model answers in text only; leave audio out", "audio")


def _check_tool_history(messages: list[Any]) -> None:
    """Past calls and their answers as OpenAI takes them: each call's function name as
    a tool's (:func:`~service.api.tool_checks.check_tool_name`), its ``arguments`` JSON
    object text or an object (:func:`~service.api.tool_checks.check_call_arguments`);
    each assistant message's ``tool_calls`` answered by the tool messages right after
    it, each once, call ids unique (:func:`~service.api.tool_checks.check_tool_history`).
    Shapes that are no call (not an object, no function) are left to the template's
    checks, which name them.

    Raises:
        APIError: 400 naming ``messages[i]`` or the part of it at fault.
    """
    turns: list[Turn] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            answer = (message.get("tool_call_id") if isinstance(message.get("tool_call_id"), str) else None,
                      f"messages[{i}]")
            if turns and turns[-1].answers:  # the run of tool messages after a call is one turn
                turns[-1] = replace(turns[-1], answers=(*turns[-1].answers, answer))
            else:
                turns.append(Turn(f"messages[{i}]", answers=(answer,)))
            continue
        calls = message.get("tool_calls") if role == "assistant" else None
        made = []
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            param = f"messages[{i}].tool_calls[{j}]"
            check_tool_name(function.get("name"), f"{param}.function.name")
            check_call_arguments(function.get("arguments", {}), f"{param}.function.arguments")
            if isinstance(call.get("id"), str):
                made.append((call["id"], param))
        turns.append(Turn(f"messages[{i}]", calls=tuple(made)))
    check_tool_history(turns, OPENAI_HISTORY)


def completion_request(
    body: CompletionRequest, request_id: str, started: float
) -> GenerationRequest:
    """A text completion's body as the request it runs as (each prompt yields ``n``
    choices).

    Raises:
        APIError: 400 naming the field (``stream_options`` without ``stream``, ``logprobs``, ``suffix``, ``best_of``,
            ``prompt``, ``stop``, ``logit_bias``, ``response_format``); 400 ``too_many_sequences`` for more
            than :data:`MAX_SEQUENCES` prompts times ``n`` (:func:`check_sequences`).
    """
    logit_bias, stop = logit_bias_pairs(body.logit_bias), stop_strings(body.stop)
    check_stream_options(body.stream_options, body.stream)
    if body.logprobs is not None:
        check_logprobs_count(body.logprobs, "logprobs")
    if body.suffix:
        raise invalid("suffix is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of other than n is not supported by this server", "best_of")
    items = prompt_items(body.prompt)
    check_sequences(len(items), body.n)
    json_schema = response_schema(body.response_format)
    return GenerationRequest(
        request_id=request_id,
        started=started,
        prompts=tuple(completion_prompts_of(items)),
        sampling=sampling_of(body),
        n=body.n,
        max_tokens=body.max_tokens,
        default_max_tokens=COMPLETION_MAX_TOKENS,
        stop=tuple(stop),
        logit_bias=logit_bias,
        logprobs=body.logprobs,
        echo=body.echo,
        json_schema=json_schema,
        stream=body.stream,
    )


def check_sequences(prompts: int, n: int) -> None:
    """One call runs ``prompts * n`` sequences; more than :data:`MAX_SEQUENCES` would
    hold the engine's batch from every other client for the call's whole length.

    Raises:
        APIError: 400 ``too_many_sequences`` naming ``n`` (when above 1, else
            ``prompt``) with the limit.
    """
    if prompts * n > MAX_SEQUENCES:
        raise invalid(
            f"this call asks for {prompts} prompts x n={n} = {prompts * n} sequences; at most "
            f"{MAX_SEQUENCES} are served per call: send fewer prompts or a smaller n",
            "n" if n > 1 else "prompt",
            "too_many_sequences",
        )


def check_stream_options(stream_options: Any, stream: bool) -> None:
    """``stream_options`` only with ``"stream": true``, as OpenAI and vLLM take it
    (chat and text completions, Responses).

    Raises:
        APIError: 400 ``stream_options`` on a call that does not stream.
    """
    if stream_options is not None and not stream:
        raise invalid(
            "stream_options is only allowed when stream is true: send \"stream\": true, "
            "or leave stream_options out",
            "stream_options",
        )


def _token_ids(items: list[Any]) -> bool:
    """Whether every item is a token id: a JSON integer (``true`` and ``1.0`` are not)."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def prompt_items(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of strings / token id lists.

    Raises:
        APIError: 400 ``prompt``: ``invalid_value`` for an empty list,
            ``invalid_type`` for a mixed list or an item of another JSON type (a
            boolean or a fraction among token ids too, which the worker's decoder
            would refuse, exiting).
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if _token_ids(prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and _token_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token id lists (token ids are integers)",
        "prompt",
        INVALID_TYPE,
    )
