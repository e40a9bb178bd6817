"""One API call's prompts, from the forms the API takes to token ids.

A :class:`Prompt` is one prompt as the call gave it: chat messages (through the model's
chat template), a text (tokenized as is) or token ids (checked against the
vocabulary). :func:`encode_prompts` turns a call's prompts into ids, in the order the
API's errors come in: every text bounded untokenized first (400
``context_length_exceeded`` before any tokenizing, see
:meth:`service.api.text.TextSide.min_tokens`), then each prompt encoded in the text
side's threads or checked, in turn. It is a step of
:meth:`service.api.generation.Generation.start`.

The routes build a call's prompts (:func:`chat_prompt`, :func:`completion_prompts_of`)
into its :class:`~service.api.request.GenerationRequest`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.wire.messages import EngineInfo
from service.api.text import TextSide
from service.common.errors import invalid


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


@dataclass(frozen=True)
class Prompt:
    """One prompt of an API call, in one of three forms (exactly one is set).

    Args:
        param: the field its errors name (``messages``, ``prompt``, ``prompt[1]``).
        messages: chat messages, rendered through the model's chat template.
        text: a raw prompt, tokenized as is (BOS added as the tokenizer does).
        token_ids: ids the client tokenized, checked against the vocabulary.
        tools: tool definitions the chat template renders with ``messages``
            (:mod:`service.api.tools`), or None.
        template_kwargs: extra variables for the chat template
            (``chat_template_kwargs``), or None.
        ids: the ids ``messages`` (with ``tools`` and ``template_kwargs``) or ``text``
            encode to, where they were tokenized already (fitted to a call's context,
            :mod:`service.api.prompt_fit`): :func:`encode_prompts` takes them rather than
            tokenizing the prompt again. None: not tokenized yet.
    """

    param: str
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    ids: list[int] | None = None


def chat_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    param: str = "messages",
) -> list[Prompt]:
    """A chat call's one prompt (``tools``, ``template_kwargs`` and ``param``, the
    field its errors name, ``input`` for a Responses call: see :class:`Prompt`)."""
    return [Prompt(param, messages=messages, tools=tools, template_kwargs=template_kwargs)]


def completion_prompts_of(items: Sequence[str | list[int]]) -> list[Prompt]:
    """A text completion's prompts (:func:`service.api.openai.requests.prompt_items`), each named
    ``prompt`` when alone, else ``prompt[i]``."""
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(Prompt(param, text=item))
        else:
            prompts.append(Prompt(param, token_ids=item))
    return prompts


async def encode_prompts(
    text: TextSide,
    prompts: Sequence[Prompt],
    info: EngineInfo,
    context_tokens: int | None = None,
) -> list[list[int]]:
    """The token ids of each prompt, in order (a prompt's :attr:`Prompt.ids` where it
    was tokenized already).

    Args:
        context_tokens: the context the prompts must fit; None:
            ``info.max_context_tokens``.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming the prompt's field when its
            text cannot fit the context (checked for every prompt
            before any is tokenized); 400 naming it for a token id outside the
            vocabulary or an empty raw prompt.
        engine.text.chat.ChatTemplateError: messages the template cannot render
            (answered 400 by :mod:`service.common.errors`).
    """
    context = info.max_context_tokens if context_tokens is None else context_tokens
    for prompt in prompts:
        if prompt.messages is not None:
            texts = message_texts(prompt.messages)
        elif prompt.text is not None:
            texts = [prompt.text]
        else:
            continue
        check_prompt_bound(text, texts, context, prompt.param)
    encoded: list[list[int]] = []
    for prompt in prompts:
        if prompt.messages is not None:
            if prompt.ids is None:
                encoded.append(await text.encode_chat(
                    prompt.messages, tools=prompt.tools, template_kwargs=prompt.template_kwargs
                ))
            else:
                encoded.append(prompt.ids)
            continue
        if prompt.text is not None:
            ids = await text.encode_prompt(prompt.text) if prompt.ids is None else prompt.ids
        else:
            ids = prompt.token_ids or []
            bad = next((t for t in ids if t < 0 or t >= info.vocab_size), None)
            if bad is not None:
                raise invalid(
                    f"token id {bad} is outside the vocabulary (0..{info.vocab_size - 1})",
                    prompt.param,
                )
        if not ids:
            raise invalid("prompt must not be empty", prompt.param)
        encoded.append(ids)
    return encoded
