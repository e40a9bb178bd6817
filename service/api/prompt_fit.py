"""Prompts cut to fit a call's context, as Ollama does rather than refusing them
(``truncate``, its default): a chat drops its oldest turns, its system messages and its
last turn kept, until the rendered prompt leaves room for one new token; a raw prompt
keeps its last tokens. A chat whose system messages and last turn alone pass the context
is left as it is, to be refused with the usual 400 ``context_length_exceeded``.

Source: Ollama's ``server/prompt.go`` (``chatPrompt`` drops messages from the front
until the prompt fits ``num_ctx``) and its runner's truncation of a long raw prompt.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from service.api.prompts import Prompt
from service.api.text import TextSide

log = logging.getLogger("headroom.api")


async def fit_prompt(text: TextSide, prompt: Prompt, context: int) -> Prompt:
    """``prompt`` cut to fewer than ``context`` tokens where Ollama would cut it (see the
    module docstring); the same prompt where it fits or cannot be cut.

    Args:
        context: the call's context in tokens (prompt plus answer).
    """
    if prompt.messages is not None:
        messages = list(prompt.messages)
        dropped = 0
        while True:
            ids = await text.encode_chat(messages, tools=prompt.tools, template_kwargs=prompt.template_kwargs)
            older = [i for i, m in enumerate(messages[:-1]) if m.get("role") not in ("system", "developer")]
            if len(ids) < context or not older:
                break
            del messages[older[0]]
            dropped += 1
        if dropped:
            log.info("%s: the %d oldest messages dropped to fit a context of %d tokens", prompt.param, dropped,
                     context)
            return replace(prompt, messages=messages)
        return prompt
    if prompt.text is not None:
        ids = await text.encode_prompt(prompt.text)
        if len(ids) >= context > 1:
            log.info("%s: its first %d tokens dropped to fit a context of %d tokens", prompt.param,
                     len(ids) - context + 1, context)
            return replace(prompt, text=None, token_ids=ids[len(ids) - context + 1:])
    return prompt
