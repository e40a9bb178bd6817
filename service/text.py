"""The service's text side: the tokenizer, prompts to ids (in threads), ids to text.

The worker deals in token ids only; this module turns API text into ids and back,
using :mod:`engine.text` (chat template, incremental detokenizer, stop strings).
Encoding runs in a small thread pool, so a long prompt never blocks the event loop.
Incremental decoding stays on the loop: each call decodes a window of a few tokens
(microseconds), and a thread hop per token would cost more than it saves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.text.chat import encode_chat, encode_prompt
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import load_tokenizer  # the engine's: generate and serve tokenize alike


class TextSide:
    """A loaded tokenizer and the pool its encoding runs in.

    Args:
        tokenizer: a Hugging Face tokenizer.
        model_dir: the folder it came from (a restart with the same folder keeps it).
        threads: encoding threads (the Rust tokenizer releases the GIL while it works).
    """

    def __init__(self, tokenizer: Any, model_dir: str, threads: int = 4) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    @classmethod
    async def load(cls, model_dir: str) -> TextSide:
        """Load the tokenizer of ``model_dir`` in a thread (it takes about a second)."""
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        return cls(tokenizer, model_dir)

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Chat messages to prompt ids through the model's template (ending with the
        assistant generation header).

        Raises:
            engine.text.chat.ChatTemplateError: roles or content the template cannot
                render; its ``param`` names the field.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, encode_chat, self.tokenizer, messages)

    async def encode_prompt(self, prompt: str) -> list[int]:
        """A raw completion prompt to ids (BOS added as the tokenizer does)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, encode_prompt, self.tokenizer, prompt)

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one sequence that follows ``prompt_ids``."""
        return IncrementalDetokenizer(self.tokenizer, prompt_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
