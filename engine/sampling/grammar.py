"""Structured output: JSON-schema-constrained sampling with xgrammar.

A request whose :class:`~engine.messages.SamplingParams` carries ``json_schema`` (JSON
text of a JSON Schema) gets a grammar matcher on its :class:`SamplingState`. Each step,
before the sampler's penalties and filters, the tokens that cannot continue a string
the schema accepts get ``-inf`` (xgrammar's token bitmask, filled on the host, applied
on the logits' device: one host-to-device copy of ``ceil(V / 32)`` int32 words per
constrained row and step); each sampled token then advances the matcher. Once the JSON
value is complete only the end tokens remain, so the answer ends there.

Grammars are compiled once per schema text (xgrammar's compiler caches them) against
the model's tokenizer, loaded on the first constrained request. JSON is compact (no
whitespace between tokens the schema does not need), so a model cannot pad forever.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class GrammarError(ValueError):
    """A schema xgrammar cannot compile (unsupported keyword, invalid JSON...)."""


class GrammarCompiler:
    """Compiles JSON schemas for one model.

    Args:
        model_dir: the model folder (its tokenizer files).
        vocab_size: ``V``, the width of the model's logits (may exceed the tokenizer's).
        stop_token_ids: the ids that end an answer (EOS and the like).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        from engine.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(model_dir))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._xgr = xgrammar
        self._compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def matcher(self, json_schema: str) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` for ``json_schema`` (JSON text).

        Raises:
            GrammarError: the schema does not compile; the message says why.
        """
        try:
            compiled = self._compiler.compile_json_schema(json_schema, any_whitespace=False)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError for bad schemas
            raise GrammarError(f"the JSON schema cannot be used: {exc}") from None
        return self._xgr.GrammarMatcher(compiled)


def apply_grammars(logits: torch.Tensor, matchers: list[Any | None]) -> torch.Tensor:
    """``logits`` with each constrained row's disallowed tokens at ``-inf``;
    ``logits`` itself when no row has a matcher, else a new float32 tensor.

    Args:
        logits: ``[B, V]`` float.
        matchers: ``B`` entries, a row's ``xgrammar.GrammarMatcher`` or None.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return logits
    import xgrammar

    vocab = logits.shape[1]
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab)  # [B, ceil(V/32)] int32
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    x = logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(x, bitmask.to(x.device), indices=rows)
    return x
