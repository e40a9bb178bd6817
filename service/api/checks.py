"""The checks of one API call that need neither the tokenizer nor the engine: fields
this server refuses rather than ignores, OpenAI's four prompt forms, and a cheap lower
bound on a prompt's tokens against the context (before any tokenizing).

Each refusal is a 400 naming the field (:func:`service.common.errors.invalid`).
"""

from __future__ import annotations

from typing import Any

from engine.wire.messages import MAX_LOGPROBS
from service.common.errors import invalid
from service.api.schemas import ChatCompletionRequest, CompletionRequest
from service.api.structured import response_schema
from service.api.text import TextSide


def check_chat_fields(req: ChatCompletionRequest) -> None:
    """Refuse what we cannot honour instead of ignoring it (see :mod:`service.api.schemas`)."""
    if req.top_logprobs is not None:
        _check_logprobs_count(req.top_logprobs, "top_logprobs")
        if req.top_logprobs > 0 and not req.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.functions or req.function_call not in (None, "none", "auto"):
        # The deprecated form of tools; tools themselves: service.api.tools.
        raise invalid("functions are not supported; send tools instead", "functions")
    response_schema(req.response_format)
    if not req.messages:
        raise invalid("messages must not be empty", "messages")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Check the fields only chat has not, and return the prompts (:func:`prompt_items`)."""
    _check_completion_fields(req)
    return prompt_items(req.prompt)


def _check_completion_fields(req: CompletionRequest) -> None:
    if req.logprobs is not None:
        _check_logprobs_count(req.logprobs, "logprobs")
    if req.suffix:
        raise invalid("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid("best_of other than n is not supported by this server", "best_of")


def _check_logprobs_count(k: int, param: str) -> None:
    """Alternatives per token: 0..20, as OpenAI's bound."""
    if isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS:
        raise invalid(f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {k}", param)


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text of chat messages: string contents and the ``text`` of content parts."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
    return texts


def check_prompt_bound(text: TextSide, texts: list[str], context_tokens: int, param: str) -> None:
    """Refuse, untokenized, a prompt that cannot fit the context (see
    :meth:`service.api.text.TextSide.min_tokens`).

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param``.
    """
    floor = text.min_tokens(texts)
    if floor > context_tokens:
        raise invalid(
            f"This model's maximum context length is {context_tokens} tokens. However, your "
            f"prompt is at least {floor} tokens (a token here stands for at most "
            f"{text.bytes_per_token} bytes of text). Please shorten the prompt.",
            param,
            "context_length_exceeded",
        )


def prompt_items(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of strings / token id lists.

    Raises:
        APIError: 400 ``prompt`` for an empty or mixed list.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token id lists",
        "prompt",
    )
