"""``headroom generate``: one prompt through an in-process engine, streamed to a file.

This runs the engine in the caller's process (the CLI's, never the service's).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.text.chat import encode_chat
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import load_tokenizer
from engine.wire.messages import FINISH_ERROR, GenerateRequest, SamplingParams


class GenerationFailed(Exception):
    """The engine ended the request with an error (``finish_reason="error"``).

    Attributes:
        code: the engine's error code, e.g. ``"out_of_memory"``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def stream_text(engine: Engine, tokenizer, prompt_ids: list[int], sampling: SamplingParams) -> Iterator[str]:
    """Run one request to completion, yielding text as it becomes complete UTF-8.

    Raises:
        engine.common.errors.RequestRejected: the prompt cannot run (e.g. too long).
        GenerationFailed: the engine failed the request (e.g. out of device memory),
            after the text produced before the failure was yielded.
    """
    engine.add_request(GenerateRequest(request_id="generate-0", prompt_token_ids=prompt_ids, sampling=sampling))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    while engine.has_work():
        for out in engine.step():
            text = detok.add(out.token_ids)
            if text:
                yield text
            if out.finished:
                tail = detok.flush()
                if tail:
                    yield tail
                if out.finish_reason == FINISH_ERROR:
                    code = out.error_code or "engine_error"
                    raise GenerationFailed(code, out.error_message or f"the engine failed the request ({code})")


def run_generate(
    *,
    model: str | None,
    prompt: str,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
    chat: bool,
    device: str = "auto",
    out: TextIO | None = None,
    config: EngineConfig | None = None,
    model_defaults: Callable[[Path], dict[str, float | int]] | None = None,
) -> None:
    """Load the model, render ``prompt`` (chat template unless ``chat`` is False) and
    stream the reply to ``out`` (None: ``sys.stdout`` at the call; ``max_tokens`` 0: an empty one, the engine not run).

    ``config`` (plan knobs and all) replaces ``EngineConfig(model=model, device=device)``
    when given; ``model`` and ``device`` are then ignored. ``model_defaults`` maps the
    loaded model's folder to its recommended sampling fields (by
    :class:`engine.wire.messages.SamplingParams` names), used for every field the call
    leaves unset (``temperature`` None); without it, unset means SamplingParams' own.

    Raises:
        engine.common.load_errors.ModelLoadError: the model is missing or broken.
        engine.common.errors.PlanDoesNotFit: the memory plan cannot hold the model and one request.
        engine.text.chat.ChatTemplateError: the template cannot render the prompt.
        engine.common.errors.RequestRejected: the prompt does not fit.
        GenerationFailed: the engine failed the request (e.g. ``out_of_memory``).
    """
    out = sys.stdout if out is None else out  # read at the call: a caller may have swapped it
    engine = Engine(config if config is not None else EngineConfig(model=model, device=device))
    tokenizer = load_tokenizer(str(engine.model_dir))
    if chat:
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    else:
        ids = list(tokenizer.encode(prompt))
    if max_tokens > 0:  # 0 asks for no token, as the API's max_tokens 0 does
        fields = dict(model_defaults(engine.model_dir)) if model_defaults is not None else {}
        if temperature is not None:
            fields["temperature"] = temperature
        sampling = SamplingParams(max_new_tokens=max_tokens, seed=seed, **fields)
        for text in stream_text(engine, tokenizer, ids, sampling):
            out.write(text)
            out.flush()
    out.write("\n")
