"""Structured output: JSON-schema-constrained sampling with xgrammar.

A request whose :class:`~engine.wire.messages.SamplingParams` carries ``json_schema`` (JSON
text of a JSON Schema) gets a grammar matcher on its :class:`SamplingState`. Each step,
before the sampler's penalties and filters, the tokens that cannot continue a string
the schema accepts get ``-inf`` (xgrammar's token bitmask, filled on the host, applied
on the logits' device: one asynchronous host-to-device copy of ``ceil(V / 32)`` int32
words per row and step, no sync; see :func:`apply_grammars`); each sampled token then
advances the matcher. Once the JSON
value is complete only the end tokens remain, so the answer ends there.

Grammars are compiled against the model's tokenizer (loaded on the first constrained
request) in a background thread, so the engine's steps go on meanwhile
(:meth:`GrammarCompiler.compile`), and kept by schema text (the last
:data:`CACHED_GRAMMARS`). A compile that takes longer than
:data:`COMPILE_TIMEOUT_S` fails its request (the compile itself runs on, as xgrammar
cannot be interrupted, and its grammar is kept for the next request with that schema).
JSON is one line with json.dumps's default separators (``", "`` and ``": "``) and no
other whitespace outside strings (:data:`SEPARATORS`), so a model cannot pad forever.
A schema xgrammar refuses is a :class:`GrammarError` whose message is xgrammar's reason
without its log prefix (time, C++ source line).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

# Seconds a JSON schema's grammar may take to compile before its request fails (xgrammar
# compiles common schemas in milliseconds; deeply nested or huge ones take seconds).
COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept, by schema text, most recently used last.
CACHED_GRAMMARS = 64
# Comma and colon between JSON items: how models write JSON in their training text
# (json.dumps's default), and fixed, so there is no whitespace to choose.
SEPARATORS = (", ", ": ")
# xgrammar's C++ errors start with its log prefix ("[03:53:55] /project/cpp/x.cc:5082: ")
# and, for a failed internal check, "Check failed: (cond) is false: ": neither helps
# the API's caller.
_XGRAMMAR_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_reason(exc: BaseException) -> str:
    """The reason in an xgrammar exception, without its log prefix and trailing newline."""
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()


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
        self.timeout_s = COMPILE_TIMEOUT_S
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def _compile(self, json_schema: str) -> Any:
        try:
            return self._compiler.compile_json_schema(
                json_schema, any_whitespace=False, separators=SEPARATORS
            )
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError for bad schemas
            raise GrammarError(f"the JSON schema cannot be used: {xgrammar_reason(exc)}") from None

    def compile(self, json_schema: str) -> Future:
        """The compiled grammar of ``json_schema`` (JSON text), as a future: done at once
        for a schema compiled before, else compiling in the background thread. Its
        result is an ``xgrammar.CompiledGrammar``; its exception a :class:`GrammarError`
        (a failed compile is not kept)."""
        future = self._cache.get(json_schema)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(json_schema)
            return future
        future = self._cache[json_schema] = self._pool.submit(self._compile, json_schema)
        while len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def matcher_of(self, compiled: Any) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` over a compiled grammar."""
        return self._xgr.GrammarMatcher(compiled)

    def matcher(self, json_schema: str) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` for ``json_schema`` (JSON text), waiting
        for its compile at most ``timeout_s`` seconds.

        Raises:
            GrammarError: the schema does not compile, or not in time; the message says why.
        """
        future = self.compile(json_schema)
        try:
            return self.matcher_of(future.result(timeout=self.timeout_s))
        except TimeoutError:
            raise GrammarError(self.timeout_message()) from None

    def timeout_message(self) -> str:
        return (f"the JSON schema's grammar did not compile within {self.timeout_s:g} s; "
                "use a smaller or less nested schema")


# Per CUDA device: a pinned host bitmask and its device twin, grown as needed.
_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _device_bitmask(rows: int, words: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([rows, words] pinned host, [rows, words] device)`` int32 views of persistent
    buffers. Reusing the host buffer next step is safe: the step reads its sampled ids
    back (a sync on the same stream) after this step's copy was queued."""
    host, dev = _BUFFERS.get(device, (None, None))
    if host is None or host.shape[0] < rows or host.shape[1] != words:
        host = torch.empty(max(rows, 8), words, dtype=torch.int32, pin_memory=True)
        dev = torch.empty(host.shape, dtype=torch.int32, device=device)
        _BUFFERS[device] = (host, dev)
    return host[:rows], dev[:rows]


def apply_grammars(logits: torch.Tensor, matchers: list[Any | None]) -> torch.Tensor:
    """``logits`` with each constrained row's disallowed tokens at ``-inf``;
    ``logits`` itself when no row has a matcher, else a new float32 tensor.

    The bitmask (``int32 [B, ceil(V / 32)]``, a set bit for an allowed token) is filled
    on the host: xgrammar's matchers run on the CPU. On CUDA it goes to the device in
    one asynchronous copy from pinned memory and is applied there with xgrammar's
    ``apply_token_bitmask_inplace`` kernel: no device-to-host transfer and no sync per
    token (the step's one sync stays reading the sampled ids).

    Args:
        logits: ``[B, V]`` float.
        matchers: ``B`` entries, a row's ``xgrammar.GrammarMatcher`` or None.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return logits
    import xgrammar

    batch, vocab = logits.shape
    if logits.device.type == "cuda":
        words = (vocab + 31) // 32
        host, bitmask = _device_bitmask(batch, words, logits.device)
        for i in rows:
            matchers[i].fill_next_token_bitmask(host, i)
        bitmask.copy_(host, non_blocking=True)
    else:
        bitmask = xgrammar.allocate_token_bitmask(batch, vocab)  # [B, ceil(V/32)] int32
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
    x = logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(x, bitmask, indices=rows)
    return x
