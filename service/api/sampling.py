"""A request's sampling fields, their ranges declared once, and the engine's
:class:`~engine.wire.messages.SamplingParams` they become.

:class:`Sampling` holds the fields every door sets by the same names (OpenAI's bodies
inherit them, Ollama's ``options`` are converted into it): their ranges are declared on
the fields (``msgspec.Meta``; those ``headroom generate`` shares come from
:mod:`service.common.ranges`), so decoding refuses a value outside them with a 400 naming
the field, once, and the OpenAPI document states them. Nothing after the decode checks
them again until the engine (:meth:`engine.core.engine.Engine.add_request`).
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta

from engine.wire.messages import SamplingParams, ThinkingBudget
from service.api.sampling_defaults import SamplingDefaults
from service.common.errors import invalid
from service.common.ranges import (
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
)

TOP_K_MAX = (1 << 31) - 1

# ``seed``: any integer in 0..2**63-1 (a signed 64-bit integer in every client's
# language; the engine's generator takes 64 bits). Choice ``i`` of ``n`` uses
# ``(seed + i) mod 2**63``. top_k beyond the vocabulary means "off"; its bound keeps it
# a 32-bit integer on its way to the engine.
Seed = Annotated[int, Meta(ge=SEED_MIN, le=SEED_MAX)]
TopK = Annotated[int, Meta(ge=-1, le=TOP_K_MAX)]
Temperature = Annotated[float, Meta(ge=TEMPERATURE_MIN, le=TEMPERATURE_MAX)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)]

# OpenAI's bounds of a logit_bias value; -100 and 100 ban or force a token in practice.
LOGIT_BIAS_MAX = 100.0


class Sampling(msgspec.Struct, kw_only=True):
    """How the next token is picked; None: the model's default
    (:mod:`service.api.sampling_defaults`). ``top_k`` -1 and 0 are off; ``top_p`` is in
    (0, 1]; ``repetition_penalty`` in [0.01, 10]; penalties in [-2, 2]."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False


_OPENAI_DEFAULTS = SamplingDefaults()


def sampling_of(body: Sampling) -> Sampling:
    """The sampling fields of a body that inherits :class:`Sampling` (a copy: the
    body is not kept)."""
    return Sampling(**{name: getattr(body, name) for name in Sampling.__struct_fields__})


def sampling_params(
    fields: Sampling,
    max_new_tokens: int,
    seed_offset: int,
    defaults: SamplingDefaults = _OPENAI_DEFAULTS,
    json_schema: str | None = None,
    *,
    logit_bias: tuple[tuple[int, float], ...] = (),
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    thinking: ThinkingBudget | None = None,
) -> SamplingParams:
    """The engine's sampling of one sequence. An unset field takes its value from
    ``defaults`` (the model's generation config; OpenAI's: temperature 1, top_p 1).
    With a seed, sequence ``i`` of ``n`` uses ``seed + i`` so its choices differ yet
    repeat run to run. ``json_schema``: the JSON schema (as text) the answer is
    constrained to (:mod:`service.api.structured`), or None; ``logit_bias``: checked
    pairs (:func:`logit_bias_pairs`); ``logprobs`` / ``prompt_logprobs``: alternatives
    per generated / prompt token, or None; ``thinking``: the cap on a thinking block,
    or None. The ranges were checked where ``fields``
    was decoded."""
    seed = None if fields.seed is None else (fields.seed + seed_offset) % (SEED_MAX + 1)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=defaults.temperature if fields.temperature is None else fields.temperature,
        top_k=defaults.top_k if fields.top_k is None else max(0, fields.top_k),
        top_p=defaults.top_p if fields.top_p is None else fields.top_p,
        min_p=defaults.min_p if fields.min_p is None else fields.min_p,
        seed=seed,
        repetition_penalty=(
            defaults.repetition_penalty
            if fields.repetition_penalty is None
            else fields.repetition_penalty
        ),
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        ignore_eos=fields.ignore_eos,
        logit_bias=logit_bias,
        json_schema=json_schema,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        thinking=thinking,
    )


# A logit_bias key: a token id in plain ASCII digits (a minus sign for the refusal of a
# negative id to name the vocabulary's range).
_TOKEN_KEY = re.compile(r"-?(0|[1-9][0-9]*)")


def logit_bias_pairs(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as text -> bias) as the engine's pairs (their
    ids against the vocabulary are checked once the engine's facts are known, by
    :meth:`service.api.generation.Generation.start`).

    Raises:
        APIError: 400 ``logit_bias`` for a key that is not a token id or a bias outside
            [-100, 100] (a negative id is refused with the vocabulary's range by
            :func:`check_vocabulary`).
    """
    pairs: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        # A token id as OpenAI's clients write it ("15496", "-1"): no spaces, signs, digits
        # of other scripts or leading zeros, so that two keys never name one token unseen.
        if not _TOKEN_KEY.fullmatch(key):
            raise invalid(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        token = int(key)
        if token in pairs:
            raise invalid(f"logit_bias names token id {token} twice", "logit_bias")
        if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise invalid(
                f"logit_bias values must be in [-100, 100], got {bias} for {key}", "logit_bias"
            )
        pairs[token] = float(bias)
    return tuple(pairs.items())


def check_vocabulary(pairs: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """``logit_bias`` ids against the served vocabulary.

    Raises:
        APIError: 400 ``logit_bias`` for an id below 0 or at or past ``vocab_size``.
    """
    for token, _ in pairs:
        if not 0 <= token < vocab_size:
            raise invalid(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                "logit_bias",
            )
