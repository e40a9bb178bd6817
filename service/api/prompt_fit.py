"""Prompts cut to fit a call's context, as Ollama does rather than refusing them
(``truncate``, its default; Responses' ``truncation: "auto"`` too), with room left for
the answer: one rule for a chat, a templated ``/api/generate`` and a raw prompt.

The room (:func:`answer_room`): a prompt keeps at most ``context - min(N, context // 2)``
tokens, ``N`` the completion's length asked for (Ollama's ``num_predict``, else
``--default-max-tokens``); with no limit (``num_predict`` -1 or -2, or a default of 0),
half the context, as Ollama's context shift frees half of it when an answer reaches its
end. ``num_predict`` 0 keeps no room.

How a prompt is cut to that budget:

- a chat (or a templated ``/api/generate``, a chat of its system and user messages)
  first drops its oldest turns, its system messages and its last turn kept (Ollama's
  ``chatPrompt``); then, where that is not enough, the longest message loses the start
  of its text (a list of text parts as the one text the template joins them into), the
  next longest after it where it is emptied, until the rendered prompt fits (Ollama's
  runner cuts the input's start past its ``num_keep`` tokens: the template's head and
  the end of the conversation are kept here alike);
- a raw prompt keeps its last tokens, after the tokens the tokenizer puts first (a BOS).

Where the template's own tokens pass the budget (a tiny ``num_ctx``), a chat is cut to
fill the context but one token instead; where they fill the context, it is refused with
400 ``context_length_exceeded`` naming the tokens the template takes and the fix (the
call's ``context_param``, else a shorter prompt).

A fitted prompt carries the ids its last rendering gave (:attr:`Prompt.ids`, or
``token_ids`` for a cut raw prompt), which :func:`service.api.prompts.encode_prompts`
hands on: a call's prompt is rendered and tokenized once, not again after its fit.

Source: Ollama's ``server/prompt.go`` (``chatPrompt``) and its runner's truncation of an
input longer than ``num_ctx`` (``runner/ollamarunner``: ``numKeep``, context shift).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.text.chat import PART_SEPARATOR
from service.api.prompts import Prompt
from service.api.text import TextSide
from service.common.errors import invalid

if TYPE_CHECKING:
    from service.api.request import GenerationRequest

log = logging.getLogger("headroom.api")

# The most times the longest message is cut again: a cut's first tokens may merge with
# the template's text into fewer tokens than counted, so the rendered prompt can still
# pass the budget by a token or two; each pass cuts at least one more token.
_MAX_CUTS = 16


def answer_room(request: GenerationRequest, context: int) -> int:
    """Tokens of ``context`` a cut prompt leaves for the answer (see the module
    docstring): ``min(N, context // 2)``, ``N`` the call's ``max_tokens`` or else its
    ``default_max_tokens``; ``context // 2`` with neither; 0 for ``max_tokens`` 0.

    Args:
        request: the call (its ``max_tokens`` and ``default_max_tokens``, tokens).
        context: the call's context in tokens (prompt plus answer).
    """
    wanted = request.max_tokens if request.max_tokens is not None else request.default_max_tokens
    half = context // 2
    return half if wanted is None else min(wanted, half)


async def fit_prompts(text: TextSide, request: GenerationRequest, context: int) -> tuple[Prompt, ...]:
    """The call's prompts, each cut by :func:`fit_prompt` to leave :func:`answer_room`
    where the call asks for it (``request.truncate``: Ollama's routes, Responses'
    ``truncation: "auto"``); else as they are.

    Raises:
        APIError: as :func:`fit_prompt`.
    """
    if not request.truncate:
        return request.prompts
    room = answer_room(request, context)
    return tuple([await fit_prompt(text, p, context, room, request.context_param) for p in request.prompts])


async def fit_prompt(
    text: TextSide, prompt: Prompt, context: int, room: int, context_param: str | None = "num_ctx"
) -> Prompt:
    """``prompt`` cut to at most ``context - room`` tokens (see the module docstring),
    with the ids it encodes to (:attr:`Prompt.ids`: tokenized once per call); the same
    prompt where it holds token ids.

    Args:
        context: the call's context in tokens (prompt plus answer).
        room: tokens kept for the answer (:func:`answer_room`).
        context_param: the call's field that sets its context (``num_ctx``), named as
            the fix when even the cut prompt fills it; None: a shorter prompt is.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``prompt.param`` for a chat that
            takes ``context`` tokens or more with the text of every message cut.
        engine.text.chat.ChatTemplateError: messages the template cannot render.
    """
    budget = max(context - room, 1)
    if prompt.messages is not None:
        return await _fit_chat(text, prompt, budget, context, context_param)
    if prompt.text is not None:
        ids = await text.encode_prompt(_tail(prompt.text, _tail_chars(text, budget)))
        if len(ids) > budget:
            head = min(len(await text.encode_prompt("")), budget - 1)  # what the tokenizer puts first
            log.info("%s: %d tokens after its first %d dropped to fit %d tokens of a context of %d", prompt.param,
                     len(ids) - budget, head, budget, context)
            return replace(prompt, text=None, token_ids=ids[:head] + ids[len(ids) - budget + head:])
        return replace(prompt, ids=ids)
    return prompt


async def _fit_chat(text: TextSide, prompt: Prompt, budget: int, context: int, context_param: str | None) -> Prompt:
    """A chat's oldest turns dropped, then its longest messages' starts cut, until it
    renders to at most ``budget`` tokens (``context - 1`` where the template's own
    tokens pass ``budget``), with the ids it renders to."""

    async def render(messages: list[dict[str, Any]]) -> list[int]:
        return await text.encode_chat(messages, tools=prompt.tools, template_kwargs=prompt.template_kwargs)

    limit = _tail_chars(text, budget)
    messages = [m if _text_length(m) <= limit else {**m, "content": _tail(_text(m) or "", limit)}
                for m in prompt.messages or []]
    ids = await render(messages)
    dropped = 0
    older = [i for i, m in enumerate(messages[:-1]) if m.get("role") not in ("system", "developer")]
    if len(ids) > budget and older:
        # The fewest oldest turns whose dropping fits, found by halving: each render is
        # of the whole chat, so dropping one turn a render took a long chat's square.
        def without(count: int) -> list[dict[str, Any]]:
            gone = set(older[:count])
            return [m for i, m in enumerate(messages) if i not in gone]

        rendered: dict[int, list[int]] = {}
        low, high = 1, len(older)
        while low < high:
            middle = (low + high) // 2
            rendered[middle] = await render(without(middle))
            if len(rendered[middle]) <= budget:
                high = middle
            else:
                low = middle + 1
        dropped, messages = low, without(low)
        ids = rendered[low] if low in rendered else await render(messages)
    if dropped:
        log.info("%s: the %d oldest messages dropped to fit %d tokens of a context of %d", prompt.param, dropped,
                 budget, context)
    cut, cut_ids = await _cut_texts(text, messages, ids, budget, render)
    if budget < len(cut_ids) < context:
        # The template's own tokens pass the answer's room: the prompt fills the context
        # but one token instead.
        budget = context - 1
        cut, cut_ids = await _cut_texts(text, messages, ids, budget, render)
    if len(cut_ids) > budget:
        raise invalid(
            f"This call's context is {context} tokens. However, the prompt takes {len(cut_ids)} tokens with "
            "the text of every message cut (the chat template's own tokens), which leaves no room for a "
            "completion. " + (f"Please raise {context_param}." if context_param else "Please shorten the prompt."),
            prompt.param,
            "context_length_exceeded",
        )
    if cut != messages:
        log.info("%s: the start of its longest messages cut to fit %d tokens of a context of %d", prompt.param,
                 budget, context)
    return replace(prompt, messages=cut, ids=cut_ids)


async def _cut_texts(
    text: TextSide,
    messages: list[dict[str, Any]],
    ids: list[int],
    budget: int,
    render: Callable[[list[dict[str, Any]]], Awaitable[list[int]]],
) -> tuple[list[dict[str, Any]], list[int]]:
    """``messages`` (rendering to ``ids``, as ``render`` renders them) with the start of
    the longest message's text cut, then the next longest's, until they render to at
    most ``budget`` tokens or no text is left; and the ids they render to. The list
    given is not changed."""
    for _ in range(_MAX_CUTS):
        longest = max(range(len(messages)), key=lambda i: _text_length(messages[i]), default=None)
        if len(ids) <= budget or longest is None or not _text_length(messages[longest]):
            break
        own = await text.encode_text(_text(messages[longest]) or "")
        over = len(ids) - budget
        kept = (await text.decode(own[over:])).lstrip("\ufffd") if over < len(own) else ""
        messages = [*messages[:longest], {**messages[longest], "content": kept}, *messages[longest + 1:]]
        ids = await render(messages)
    return messages, ids


def _tail_chars(text: TextSide, budget: int) -> int:
    """Characters of a text's end that hold its last ``budget`` tokens with as many again
    to spare: ``2 * budget * L`` (``L``, :attr:`TextSide.bytes_per_token`: no token
    stands for more bytes, and a character is at least one). A longer message must lose
    its start anyway (it alone is more than ``budget`` tokens), so it is cut to that end
    before it is tokenized at all: a 30 MB message cut to a small ``num_ctx`` took three
    whole tokenizations, 40-50 s of the service's CPU, even after its client left."""
    return 2 * budget * text.bytes_per_token


def _tail(text: str, chars: int) -> str:
    """The last ``chars`` characters of ``text`` (all of it when shorter)."""
    return text if len(text) <= chars else text[-chars:]


def _text_length(message: Any) -> int:
    """The characters of a message's text content (0 for other contents: they are not
    cut)."""
    return len(_text(message) or "")


def _text(message: Any) -> str | None:
    """A message's text content: a string, or a list of text parts as the template gets
    it (joined, :data:`engine.text.chat.PART_SEPARATOR`); None for other contents."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return None
    return PART_SEPARATOR.join(p["text"] for p in content)
