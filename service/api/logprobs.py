"""The engine's token logprobs in OpenAI's two shapes.

Chat (``logprobs: true``, ``top_logprobs: k``): ``choices[].logprobs = {"content":
[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}``. Text completions (``logprobs: k``, the legacy shape):
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``;
with ``echo`` the prompt's tokens come first, the first of them with ``null`` logprobs.

What the numbers are (:class:`engine.wire.messages.TokenLogprobs`): natural-log
probabilities from the logits after ``logit_bias`` and the grammar mask, before
penalties, temperature and the top-k/top-p/min-p filters. A token's text is the
tokenizer's decoding of it alone; ``bytes`` are its raw bytes (for byte-level BPE
vocabularies a piece of a UTF-8 character is given exactly, while its text shows
U+FFFD). A ``-inf`` (a token the grammar or a bias of -100 forbids) is sent as
-9999.0, as JSON has no infinity.

The tokens spell the answer's text (:class:`ShownLogprobs`): with stop strings a
token's logprobs go out once its text has (the text a stop string might start is
held back), and when a stop string ends the answer the tokens past it are dropped; a
token that straddles the stop (text before it, then the stop's first characters) is
kept, cut: its ``token`` and ``bytes`` are its part before the stop, its
``logprob`` and ``top_logprobs`` the whole token's (it was sampled whole). The end
token that stopped the answer, and any special token the text skips (``ignore_eos``
goes on past ``<|im_end|>``), is not in its text and gets no entry (the runner leaves
it out: :meth:`service.api.generation.Generation.pieces`).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from engine.wire.messages import MAX_LOGPROBS, TokenLogprobs
from service.common.errors import invalid

FLOOR = -9999.0


def check_logprobs_count(k: int, param: str) -> None:
    """Alternatives per token: an integer in 0..20, OpenAI's bound (and Ollama's field).

    Raises:
        APIError: 400 ``param`` otherwise.
    """
    if isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS:
        raise invalid(f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {k}", param)


def check_top_logprobs(top: int | None, logprobs: bool | None) -> None:
    """A chat's ``top_logprobs`` (OpenAI's and Ollama's alike): in 0..20, and above 0
    only with ``logprobs`` true.

    Raises:
        APIError: 400 ``top_logprobs``.
    """
    if top is None:
        return
    check_logprobs_count(top, "top_logprobs")
    if top > 0 and not logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (byte-level BPE), inverted."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


_BYTES = _byte_decoder()


class TokenTexts:
    """Each token id's text and bytes, decoded once per id.

    Args:
        tokenizer: a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes as a list of ints)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(ch in _BYTES for ch in piece) and "\ufffd" in text:
                raw = [_BYTES[ch] for ch in piece]  # part of a character: its exact bytes
            else:
                raw = list(text.encode("utf-8"))
            hit = self._cache[token_id] = (text, raw)
        return hit

    def shown(self, record: TokenLogprobs) -> tuple[str, list[int]]:
        """``(text, bytes)`` of a generated token as the answer shows it: the whole
        token, or the part of it before a stop string (:class:`ClippedLogprobs`)."""
        text, raw = self.of(record.token_id)
        if isinstance(record, ClippedLogprobs):
            raw = raw[: record.shown]
            text = bytes(raw).decode("utf-8", "replace")
        return text, raw

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.of(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    def chat(self, records: list[TokenLogprobs]) -> dict[str, Any]:
        """OpenAI's chat ``logprobs`` object for ``records`` (one per token)."""
        content = []
        for r in records:
            text, raw = self.shown(r)
            entry = {"token": text, "logprob": _finite(r.logprob), "bytes": raw}
            entry["top_logprobs"] = [
                self._entry(t, lp) for t, lp in zip(r.top_ids, r.top_logprobs, strict=True)
            ]
            content.append(entry)
        return {"content": content, "refusal": None}

    def legacy(
        self, tokens: list[tuple[int, TokenLogprobs | None]], offset: int
    ) -> tuple[dict[str, Any], int]:
        """OpenAI's text-completion ``logprobs`` object for ``tokens`` (``(id, its
        record)``; None for a token without logprobs: the prompt's first), whose text
        begins at character ``offset`` of the choice's text; returns it and the offset
        after them."""
        texts: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, r in tokens:
            text = self.of(token_id)[0] if r is None else self.shown(r)[0]
            texts.append(text)
            offsets.append(offset)
            offset += len(text)
            if r is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_finite(r.logprob))
            top: dict[str, float] = {}
            for t, lp in zip(r.top_ids, r.top_logprobs, strict=True):
                top.setdefault(self.of(t)[0], _finite(lp))
            tops.append(top)
        body = {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
        return body, offset


class ClippedLogprobs(TokenLogprobs, frozen=True, array_like=True):
    """A generated token a stop string cut: only its first ``shown`` bytes are in the
    answer's text."""

    shown: int = 0


class ShownLogprobs:
    """One sequence's token logprobs, given out as the answer's text is (see the
    module docstring).

    Args:
        texts: the tokenizer's token texts (a token's bytes measure its text).
        hold: the request has stop strings: a token's logprobs wait for its text.
    """

    def __init__(self, texts: TokenTexts, hold: bool) -> None:
        self._texts = texts
        self._hold = hold
        self._pending: list[TokenLogprobs] = []
        self._shown = 0  # UTF-8 bytes of the answer's text so far
        self._given = 0  # bytes of the tokens given out so far
        self._stopped = False  # a stop string ended the answer
        self._finished = False

    def add(self, records: list[TokenLogprobs]) -> None:
        """Records of newly generated tokens, in order."""
        self._pending += records

    def show(self, text: str, *, finished: bool = False, stopped: bool = False) -> None:
        """The answer's next ``text``; ``finished`` on its last, ``stopped`` when a
        stop string ended it there."""
        self._shown += len(text.encode("utf-8"))
        self._finished = self._finished or finished or stopped
        self._stopped = self._stopped or stopped

    def take(self) -> list[TokenLogprobs]:
        """The records whose text has been shown since the last take (all of them once
        the answer ended, but those past a stop string)."""
        if not self._hold or (self._finished and not self._stopped):
            taken, self._pending = self._pending, []
            return taken
        taken = []
        while self._pending:
            record = self._pending[0]
            end = self._given + len(self._texts.of(record.token_id)[1])
            if end > self._shown:
                if not self._stopped:
                    break  # its text may still be held back
                if self._given < self._shown:  # it straddles the stop: its part before
                    fields = msgspec.structs.astuple(record)
                    taken.append(ClippedLogprobs(*fields, shown=self._shown - self._given))
                self._pending = []
                break
            taken.append(record)
            self._given = end
            self._pending.pop(0)
        return taken
