"""Token ids to text, one step at a time, never emitting half a character.

Torch-free: takes any Hugging Face tokenizer object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens of context decoded before the new ones: enough for a SentencePiece leading
# space or a byte-level BPE character (at most 4 bytes) to come out as it would in a
# full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` leaves out: the tokenizer's
    special tokens (``<|im_end|>``, EOS, padding) and its added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


class IncrementalDetokenizer:
    """Decodes a request's generated tokens as they arrive.

    Keeps a small window of ids, ``[prefix_offset, read_offset)`` already emitted and
    ``[read_offset, end)`` pending, and emits ``decode(window) - decode(emitted part)``.
    Each step decodes O(window) tokens, not the whole output. Text ending in U+FFFD
    (a UTF-8 character split across byte tokens) is held until the character
    completes, or until ``flush``.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``; :meth:`shows` reads its
            special tokens).
        prompt_ids: the prompt's token ids; its last few tokens are context, so the
            first generated token decodes with the spacing it has after the prompt.
        skip_special_tokens: leave special tokens (``<|im_end|>``) out of the text.
        special: the tokenizer's :func:`special_ids` (None: read from it when
            :meth:`shows` is first asked; ``decode`` is all that is used otherwise).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        special: frozenset[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special = special if skip_special_tokens else frozenset()  # None: read on first use
        context = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        # Only the window is kept; ids before prefix_offset are dropped as it slides.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def shows(self, token_id: int) -> bool:
        """Whether ``token_id`` has text in what this detokenizer emits (False for a
        special token it skips)."""
        if self._special is None:
            self._special = special_ids(self._tokenizer)
        return token_id not in self._special

    def add(self, token_ids: list[int]) -> str:
        """Append new token ids; return the text they complete (possibly ``""``)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing visible yet (special token skipped) or a character is still split.
            return ""
        # The new prefix starts at the old read offset: drop ids no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever is still held back (a dangling U+FFFD included); call once at
        the end of the request."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        # Cleanup rewrites spacing across token boundaries, which would break the diff.
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )
