"""The service's text side: the tokenizer, prompts to ids (in threads), ids to text.

The worker deals in token ids only; this module turns API text into ids and back,
using :mod:`engine.text` (chat template, incremental detokenizer, stop strings).
Encoding runs in a small thread pool, so a long prompt never blocks the event loop.
Incremental decoding stays on the loop: each call decodes a window of a few tokens
(microseconds), and a thread hop per token would cost more than it saves.

Before a long prompt is tokenized at all, :meth:`TextSide.min_tokens` bounds its
token count from below in O(bytes), so a prompt that cannot fit the context is
refused at once (see its docstring for why the bound is sound).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.text.chat import encode_chat, encode_prompt, template_has_tools
from engine.text.detokenizer import IncrementalDetokenizer, special_ids
from engine.text.tokenizer import load_tokenizer  # the engine's: generate and serve tokenize alike
from service.api.logprobs import TokenTexts
from service.api.tool_checks import check_calls_rendered

# Unicode composition (NFC/NFKC) can shrink input: a Hangul syllable composed of 3
# jamo (9 bytes -> 3), a letter and its combining marks. A normalizer's input bytes per
# normalized byte stay below this factor.
_NORMALIZER_SLACK = 4


def max_bytes_per_token(tokenizer: Any) -> int:
    """``L``: the most bytes of input text one token can stand for.

    The longest token in the vocabulary (special and added tokens included), measured
    as the UTF-8 bytes of its decoded text. A byte-level token that holds part of a
    character decodes to U+FFFD (3 bytes), which only overstates ``L`` and keeps
    :meth:`TextSide.min_tokens` a lower bound. A tokenizer with a normalizer may
    compose characters before splitting (fewer bytes than the input), so ``L`` is
    multiplied by a slack factor then. Takes about 0.1 s for a 50k vocabulary.
    """
    n = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i]) for i in range(n)]
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)
    normalizer = getattr(backend, "normalizer", None) if backend is not None else None
    return max(1, longest) * (_NORMALIZER_SLACK if normalizer is not None else 1)


class TextSide:
    """A loaded tokenizer and the pool its encoding runs in.

    Args:
        tokenizer: a Hugging Face tokenizer.
        model_dir: the folder it came from (a restart with the same folder keeps it).
        threads: encoding threads (the Rust tokenizer releases the GIL while it works).
    """

    def __init__(self, tokenizer: Any, model_dir: str, threads: int = 4) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # logprobs' token texts, decoded once each
        self.special_ids = special_ids(tokenizer)  # what the detokenizers skip, read once
        self.model_dir = model_dir
        self.bytes_per_token = max_bytes_per_token(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    def min_tokens(self, texts: Sequence[str]) -> int:
        """A lower bound on the tokens ``texts`` become in one prompt, in O(bytes).

        ``ceil(B / L)`` where ``B`` is the UTF-8 bytes of the texts (each stripped of
        surrounding whitespace, which a chat template may trim) and ``L`` is
        :attr:`bytes_per_token`. Sound because every token of the prompt stands for at
        most ``L`` bytes of input, and the template only adds text around the messages.
        Note the other direction does not hold: "characters >= tokens" is false for
        byte-level BPE (one emoji of 4 bytes can be 4 tokens), so only this lower bound
        may refuse a prompt untokenized.
        """
        total = sum(len(t.strip().encode("utf-8", "surrogatepass")) for t in texts)
        return math.ceil(total / self.bytes_per_token)

    @classmethod
    async def load(cls, model_dir: str) -> TextSide:
        """Load the tokenizer of ``model_dir`` in a thread (it takes about a second)."""
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        return cls(tokenizer, model_dir)

    async def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Chat messages to prompt ids through the model's template (ending with the
        assistant generation header); ``tools`` and ``template_kwargs`` reach the
        template (:func:`engine.text.chat.render_chat`).

        Raises:
            engine.text.chat.ChatTemplateError: roles or content the template cannot
                render, or tools it has no support for (an assistant message's
                ``tool_calls`` among them:
                :func:`~service.api.tool_checks.check_calls_rendered`); its ``param``
                names the field.
        """
        loop = asyncio.get_running_loop()
        work = functools.partial(
            encode_chat, self.tokenizer, messages, tools=tools, template_kwargs=template_kwargs
        )
        ids = await loop.run_in_executor(self._pool, work)
        check_calls_rendered(messages, template_has_tools(self.tokenizer))
        return ids

    async def encode_prompt(self, prompt: str) -> list[int]:
        """A raw completion prompt to ids (BOS added as the tokenizer does)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, encode_prompt, self.tokenizer, prompt)

    async def encode_text(self, text: str) -> list[int]:
        """Text to ids with no special tokens added (a continuation of a prompt)."""
        loop = asyncio.get_running_loop()
        work = functools.partial(self.tokenizer.encode, text, add_special_tokens=False)
        return list(await loop.run_in_executor(self._pool, work))

    async def decode(self, ids: list[int]) -> str:
        """Ids back to text, special tokens kept (a cut message's rest)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.decode, ids)

    def detokenizer(self, prompt_ids: list[int], keep_special: bool = False) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one sequence that follows ``prompt_ids``;
        ``keep_special``: special tokens stay in the text (a harmony answer's format)."""
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=not keep_special,
                                      special=self.special_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
