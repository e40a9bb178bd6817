"""A request's sampling parameters, checked, and its own sampling state: a random
generator seeded per request (so its tokens do not depend on what else is in the
batch) and the counts of its generated tokens (for the penalties)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

from engine.sampling.thinking import ThinkingTracker
from engine.wire.messages import MAX_LOGPROBS, SamplingParams

_SEED_MASK = (1 << 64) - 1  # torch.Generator.manual_seed takes 64 bits


def check_params(params: SamplingParams) -> None:
    """Reject sampling parameters the sampler cannot honour.

    Raises:
        ValueError: ``temperature`` < 0 or not finite, ``top_p`` not in (0, 1],
            ``min_p`` not in [0, 1], ``repetition_penalty`` <= 0 or not finite, or a
            presence/frequency penalty that is not finite. The message names the field.
    """
    if not (math.isfinite(params.temperature) and params.temperature >= 0.0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not (0.0 < params.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {params.top_p}")
    if not (0.0 <= params.min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {params.min_p}")
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0.0):
        raise ValueError(
            f"repetition_penalty must be > 0 (1 = off), got {params.repetition_penalty}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise ValueError(f"{name} must be finite, got {getattr(params, name)}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")
    for token, bias in params.logit_bias:
        if token < 0 or not math.isfinite(bias):
            raise ValueError(
                f"logit_bias needs token ids >= 0 and finite biases, got {token}: {bias}"
            )


def has_repetition_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


def has_openai_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def all_plain_greedy(params: Sequence[SamplingParams]) -> bool:
    """Every row greedy with no penalty: its token is the argmax of its logits, which a
    decode CUDA graph computes on the device (:mod:`engine.core.cuda_graphs`)."""
    return all(p.greedy and not has_repetition_penalty(p) and not has_openai_penalty(p) for p in params)


class SamplingState:
    """Mutable per-request sampling state: random generator and token counts.

    Args:
        params: the request's sampling parameters (validated with :func:`check_params`).
        prompt_ids: prompt token ids, ``list[int]`` or an int tensor of shape ``[P]``.
        vocab_size: ``V``, the width of the logits the sampler will get (the model's
            output size, which may exceed the tokenizer's vocabulary).
        device: where the logits live; the generator and count tensors are made there.

    Attributes:
        generator: ``torch.Generator`` on ``device``, seeded with ``params.seed``, or with
            a fresh 63-bit number from :mod:`secrets` when the seed is ``None`` (still one
            generator per request, so batch composition never changes its stream).
        seed: the seed actually used (for logs and for replaying a request).
        counts: ``int32 [V]`` counts of generated tokens, or ``None`` when the request
            has no penalty. Dense on ``device``: ``V * 4`` bytes per penalized request
            (600 KB at 150k vocab) buys a single-launch :meth:`append` and one stacked,
            vectorized penalty per step.
        prompt_mask: ``bool [V]``, True for tokens in the prompt, or ``None`` when the
            request has no repetition penalty.
        num_generated: tokens appended so far.
        thinking: the :class:`~engine.sampling.thinking.ThinkingTracker` of a request
            with a thinking budget, else None.

    Raises:
        ValueError: bad ``params`` (see :func:`check_params`), ``vocab_size < 1``, or a
            prompt id outside ``[0, vocab_size)``.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] | torch.Tensor,
        vocab_size: int,
        device: torch.device | str,
    ) -> None:
        check_params(params)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        outside = [t for t, _ in params.logit_bias if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias token ids {outside} are outside [0, {vocab_size})")
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed & _SEED_MASK)
        self.num_generated = 0
        # llguidance's LLMatcher for a json_schema request (set by the engine).
        self.matcher = None
        self.thinking = None if params.thinking is None else ThinkingTracker(params.thinking)

        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        if has_repetition_penalty(params) or has_openai_penalty(params):
            self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)
        if has_repetition_penalty(params):
            ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(
                    f"prompt ids must be in [0, {vocab_size}), got range "
                    f"[{int(ids.min())}, {int(ids.max())}]"
                )
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            self.prompt_mask[ids.to(self.device)] = True

    @property
    def constrained(self) -> bool:
        """Whether this step's logits are masked for the request (a grammar still
        running, or a forced token): its token is not its plain argmax."""
        live_grammar = self.matcher is not None and not self.matcher.is_terminated()
        return live_grammar or (self.thinking is not None and self.thinking.forced() is not None)

    def append(self, token_id: int) -> None:
        """Record a generated token (one device write when the request has a penalty).

        Raises:
            ValueError: ``token_id`` outside ``[0, vocab_size)``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside [0, {self.vocab_size})")
        self.num_generated += 1
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.matcher is not None and not self.matcher.is_error():
            # A token the grammar cannot take (or a limit of its parser reached) puts the
            # matcher in error: :meth:`grammar_error` says so and the request fails.
            self.matcher.consume_token(token_id)
        if self.thinking is not None:
            self.thinking.append(token_id)

    def grammar_error(self) -> str | None:
        """Why the answer can no longer follow its JSON schema (the grammar library's
        reason on one line: a parser limit such as a row of more than 2,000 items for an
        object of 1,000 optional properties), or None while it can. Ending the answer
        there would return text that violates the schema as if it were complete."""
        if self.matcher is None or not self.matcher.is_error():
            return None
        from engine.sampling.grammar import grammar_reason

        return grammar_reason(self.matcher.get_error())
