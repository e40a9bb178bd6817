"""Message text that spells a special token stays text: a user who writes
``<|im_end|>\\n<|im_start|>assistant\\n...`` in a message cannot close the turn and
forge an assistant (or system) turn of the conversation.

The chat template renders the messages to one prompt whose special tokens are written
out (``<|im_start|>``), and tokenizing it reads every such spelling as the special
token, whether the template or a message wrote it. Where a message's text holds one,
the prompt is rendered a second time with that text replaced by a marker; where the
template put the text in as it is (the first rendering is the second with each marker
replaced by its text), the tokens that lie inside the text are tokenized again with
special tokens split into plain text (``split_special_tokens``); the texts trimmed
are tried too (Llama 3's template trims each message). A template that changes the
text otherwise (splits it at a tag) gives no such match: the prompt is tokenized as it
is, as before. Prompts whose messages spell no special token are tokenized exactly
as without this module.
"""

from __future__ import annotations

import functools
import re
from typing import Any

# A message's text stands in the second rendering as MARK_OPEN + its index + MARK_CLOSE:
# private-use characters no template writes or changes.
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


def special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex matching any special token's text of ``tokenizer`` (its added tokens
    marked special), or None when it has none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = tuple(sorted({t.content for t in decoder.values() if getattr(t, "special", False) and t.content}))
    return _pattern(texts)


@functools.lru_cache(maxsize=16)
def _pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))) if texts else None


def marked(index: int) -> str:
    """The marker of the ``index``-th guarded text."""
    return f"{MARK_OPEN}{index}{MARK_CLOSE}"


def guarded_ids(tokenizer: Any, prompt: str, marked_prompt: str, texts: list[str], add_special: bool) -> list[int]:
    """The ids of ``prompt`` with the special-token spellings inside ``texts`` tokenized
    as plain text (see the module docstring).

    Args:
        prompt: the rendered prompt.
        marked_prompt: the same messages rendered with ``texts[i]`` replaced by
            :func:`marked` ``(i)``.
        texts: the guarded message texts.
        add_special: whether the tokenizer adds its special tokens (a BOS) around the
            prompt, as :func:`engine.text.chat.encode_prompt` decides.

    Returns:
        Token ids, ``list[int]``: those of plain tokenizing where the template changed
        a text (no span of ``prompt`` is known to be the message's).
    """
    encoded = tokenizer(prompt, add_special_tokens=add_special, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    # The texts as they are, else trimmed (Llama 3's template trims each message).
    spans = _spans(marked_prompt, texts, prompt) or _spans(marked_prompt, [t.strip() for t in texts], prompt)
    if spans is None:
        return ids
    offsets = encoded["offset_mapping"]
    for a, b in reversed(spans):  # the last first: the earlier spans' indices stay valid
        inside = [i for i, (s, e) in enumerate(offsets) if a <= s and e <= b and e > s]
        if inside:
            j, k = inside[0], inside[-1] + 1
            text = prompt[offsets[j][0]:offsets[k - 1][1]]
            ids[j:k] = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def _spans(marked_prompt: str, texts: list[str], prompt: str) -> list[tuple[int, int]] | None:
    """Where each marker's text lies in ``prompt`` (character spans, in order), if
    ``prompt`` is ``marked_prompt`` with each marker replaced by its text; else None."""
    spans, parts, length, at = [], [], 0, 0
    for match in _MARK.finditer(marked_prompt):
        index = int(match.group(1))
        if index >= len(texts):
            return None
        head, text = marked_prompt[at:match.start()], texts[index]
        parts += [head, text]
        spans.append((length + len(head), length + len(head) + len(text)))
        length += len(head) + len(text)
        at = match.end()
    parts.append(marked_prompt[at:])
    return spans if "".join(parts) == prompt else None
