"""Structured output: JSON-schema-constrained sampling with llguidance.

A request whose :class:`~engine.wire.messages.SamplingParams` carries ``json_schema`` (JSON
text of a JSON Schema) gets a grammar matcher (``llguidance.LLMatcher``) on its
:class:`SamplingState`. Each step, before the sampler's penalties and filters, the
tokens that cannot continue a string the schema accepts get ``-inf`` (a token bitmask,
``int32 [B, ceil(V / 32)]``, filled on the host by the matchers, applied on the logits'
device with plain torch ops: one asynchronous host-to-device copy of ``ceil(V / 32)``
int32 words per row and step, no sync; see :func:`apply_grammars`); each sampled token
then advances the matcher. Once the JSON value is complete only the end tokens remain,
so the answer ends there.

Grammars are compiled against the model's tokenizer (loaded on the first constrained
request) in a background thread, so the engine's steps go on meanwhile
(:meth:`GrammarCompiler.compile`), and kept by schema text (the last
:data:`CACHED_GRAMMARS`); a compiled grammar is a pristine matcher, and each request
gets a copy of it. A compile that takes longer than :data:`COMPILE_TIMEOUT_S` fails its
request (the compile itself runs on, as it cannot be interrupted, and its grammar is
kept for the next request with that schema). JSON is one line with json.dumps's default
separators (``", "`` and ``": "``) and no other whitespace outside strings
(:data:`SEPARATORS`), so a model cannot pad forever.

Fail closed: a schema is compiled only if every keyword in it is enforced. llguidance
refuses keywords it does not implement (``uniqueItems``, ``not``, ``if``/``then``,
``contains``...), patterns its regex engine cannot run (look-around, back-references,
``\\b``), unknown ``format`` values and ``oneOf`` it cannot prove equal to ``anyOf``;
it is never asked to be lenient or to coerce ``oneOf``, and a grammar it compiles with
any warning is refused too, as is one whose first mask already fails (no token can
begin a value: ``{"$ref": "#"}``, which only refers to itself). Such a schema is a
:class:`GrammarError` whose message is llguidance's reason on one line. What it does narrow (properties in the schema's
order, the fixed separators) only ever makes answers that still validate.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

# Seconds a JSON schema's grammar may take to compile before its request fails (common
# schemas compile in milliseconds; huge ones take longer).
COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept, by schema text, most recently used last.
CACHED_GRAMMARS = 64
# Comma and colon between JSON items: how models write JSON in their training text
# (json.dumps's default), and fixed, so there is no whitespace to choose.
SEPARATORS = (", ", ": ")
# llguidance's JSON compile options (its "x-guidance" keys), overriding any the schema
# sets: the separators above, no free whitespace, and nothing approximated.
_JSON_OPTIONS = {
    "item_separator": SEPARATORS[0],
    "key_separator": SEPARATORS[1],
    "whitespace_flexible": False,
    "lenient": False,
    "coerce_one_of": False,
}
_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


# llguidance's marker after a reason given without its parser state (verbose_errors off).
_NON_VERBOSE = "<non-verbose/>"
# Its word for a grammar that lets no token begin or continue the value.
_NO_EXTENSION = "NoExtensionBias"
# Its parser's limit on the text a grammar forces with no choice left (its "ff_tokens").
_FORCED_PAST_LIMIT = "ff_tokens"


def grammar_reason(message: str) -> str:
    """llguidance's error or warning text on one line: its lines stripped and joined,
    the caret lines under a pattern (``^^^``) and its ``<non-verbose/>`` marker
    dropped; its advice to coerce ``oneOf`` (an option this module never sets) as what
    the caller can do instead, and its ``NoExtensionBias`` (no token can start the
    value) and forced-text limit (``ff_tokens``: a schema that requires itself) as what
    is wrong with the schema."""
    if "coerce_one_of" in message:  # its advice names an option the caller cannot set
        return "oneOf is taken only where its branches cannot overlap (then it is anyOf); use anyOf"
    if _NO_EXTENSION in message:
        return ("it matches no JSON value: no text can begin one (a schema that only refers "
                "to itself, such as {\"$ref\": \"#\"}, defines nothing to write)")
    if _FORCED_PAST_LIMIT in message:
        return ("it forces more text than the parser's limit (50,000 items), as a schema "
                "does whose required property or item is the schema itself ({\"$ref\": \"#\"}): "
                "that one forces text without end, and no finite JSON value matches it")
    lines = [line.strip() for line in message.replace(_NON_VERBOSE, "").strip().splitlines()]
    return " ".join(line for line in lines if line and set(line) != {"^"})


def _is_byte_level(part: dict | None) -> bool:
    """Whether a tokenizer.json pre-tokenizer (or a sequence of them) maps bytes to
    GPT-2's printable characters (``ByteLevel``)."""
    if not part:
        return False
    if part.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(p) for p in part.get("pretokenizers", ()))


def llguidance_tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer.json text llguidance reads for ``tokenizer`` (a fast transformers
    tokenizer), with its bytes made plain for a byte-level BPE.

    Some transformers versions (5.17 among them) build a byte-level BPE read from a
    GGUF with sentencepiece's ``byte_fallback`` and a decoder sequence headed by
    ``ByteFallback``. transformers still decodes it right, but llguidance then takes
    each token's characters as its bytes (``Ġ"`` as ``C4 A0 22`` rather than `` "``):
    its masks and its parser disagree and a constrained answer fails on the first
    token after a space. A byte-level pre-tokenizer says what the tokens are, so such a
    model gets a plain BPE (no byte fallback) and the ``ByteLevel`` decoder alone.
    """
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    text = backend.to_str()
    spec = json.loads(text)
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback") and _is_byte_level(spec.get("pre_tokenizer")):
        model["byte_fallback"] = False
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        return json.dumps(spec)
    return text


class GrammarError(ValueError):
    """A schema that cannot be enforced (an unsupported keyword or pattern, invalid
    JSON...); the message says why."""


class GrammarCompiler:
    """Compiles JSON schemas for one model.

    Args:
        model_dir: the model folder (its tokenizer files).
        vocab_size: ``V``, the width of the model's logits (may exceed the tokenizer's).
        stop_token_ids: the ids that end an answer (EOS and the like); the tokenizer's
            EOS when empty.
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance

        from engine.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(model_dir))
        eos = list(stop_token_ids) or [tokenizer.eos_token_id]
        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(llguidance_tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=eos)
        # Errors name the reason only, not the parser's state and the whole grammar.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self.vocab_size = vocab_size
        self.timeout_s = COMPILE_TIMEOUT_S
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def _compile(self, json_schema: str) -> Any:
        matcher_class = self._llg.LLMatcher
        try:
            json.loads(json_schema)
            grammar = matcher_class.grammar_from_json_schema(json_schema, overrides=_JSON_OPTIONS)
        except ValueError as exc:  # not JSON, or not an object
            raise GrammarError(f"the JSON schema cannot be used: {grammar_reason(str(exc))}") from None
        matcher = matcher_class(self._tokenizer, grammar, log_level=0, limits=self._limits)
        problems = [matcher.get_error()] if matcher.is_error() else matcher.get_grammar_warnings()
        if not problems:  # one mask finds a grammar no token can begin ({"$ref": "#"})
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            problems = [probe.get_error()] if probe.is_error() else []
        if problems:
            reasons = "; ".join(grammar_reason(p) for p in problems)
            raise GrammarError(f"the JSON schema cannot be used: {reasons}")
        return matcher

    def compile(self, json_schema: str) -> Future:
        """The compiled grammar of ``json_schema`` (JSON text), as a future: done at once
        for a schema compiled before, else compiling in the background thread. Its
        result is a pristine ``llguidance.LLMatcher`` (give each request
        :meth:`matcher_of` it); its exception a :class:`GrammarError` (a failed compile
        is not kept)."""
        future = self._cache.get(json_schema)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(json_schema)
            return future
        future = self._cache[json_schema] = self._pool.submit(self._compile, json_schema)
        while len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def matcher_of(self, compiled: Any) -> Any:
        """A fresh ``llguidance.LLMatcher`` over a compiled grammar (a copy of it)."""
        return compiled.deep_copy()

    def matcher(self, json_schema: str) -> Any:
        """A fresh ``llguidance.LLMatcher`` for ``json_schema`` (JSON text), waiting
        for its compile at most ``timeout_s`` seconds.

        Raises:
            GrammarError: the schema does not compile, or not in time; the message says why.
        """
        future = self.compile(json_schema)
        try:
            return self.matcher_of(future.result(timeout=self.timeout_s))
        except TimeoutError:
            raise GrammarError(self.timeout_message()) from None

    def accepts(self, compiled: Any, text: str) -> bool:
        """Whether the grammar takes ``text`` whole (a complete value), tokenized as the
        model would write it."""
        matcher = self.matcher_of(compiled)
        return matcher.consume_tokens(self._tokenizer.tokenize_str(text)) and matcher.is_accepting()

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


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``bool [B, vocab]`` of an ``int32 [B, ceil(vocab / 32)]`` bitmask (bit ``j`` of
    word ``w``: token ``32 w + j``)."""
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_grammars(logits: torch.Tensor, matchers: list[Any | None]) -> torch.Tensor:
    """``logits`` with each constrained row's disallowed tokens at ``-inf``;
    ``logits`` itself when no row has a matcher, else a new float32 tensor.

    The bitmask (``int32 [B, ceil(V / 32)]``, a set bit for an allowed token; all bits
    set for a row without a matcher) is filled on the host, where llguidance's
    matchers run. On CUDA it goes to the device in one asynchronous copy from pinned
    memory and is applied there: no device-to-host transfer and no sync per token
    (the step's one sync stays reading the sampled ids). A matcher in error (it cannot
    happen through this mask) allows only the end tokens.

    Args:
        logits: ``[B, V]`` float.
        matchers: ``B`` entries, a row's ``llguidance.LLMatcher`` or None.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    batch, vocab = logits.shape
    words = (vocab + 31) // 32
    on_cuda = logits.device.type == "cuda"
    if on_cuda:
        host, bitmask = _device_bitmask(batch, words, logits.device)
    else:
        host = bitmask = torch.empty(batch, words, dtype=torch.int32)
    host.fill_(-1)
    for i in rows:
        matchers[i].unsafe_compute_mask_ptr(host[i].data_ptr(), words * 4)
    if on_cuda:
        bitmask.copy_(host, non_blocking=True)
    x = logits.float().clone()
    return x.masked_fill_(~_allowed(bitmask, vocab), float("-inf"))
