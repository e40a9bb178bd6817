"""Per-request state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.kvcache.radix import RadixNode
from engine.sampling.state import SamplingState
from engine.wire.messages import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    PREFILL = "prefill"  # admitted; prompt (or, after preemption, prompt + output) being filled in chunks
    DECODE = "decode"  # one new token per step
    FINISHED = "finished"  # includes aborted and failed


@dataclass(eq=False)
class Request:
    """One request's tokens, pages and progress.

    ``kv_len`` tokens of ``all_ids`` have their keys/values in ``pages``; the next step
    feeds ``all_ids[kv_len:]`` (one token in decode, a chunk in prefill).
    ``cached_len`` leading tokens sit in pages owned by the radix cache (pinned through
    ``last_node``); the pages after them are the request's own.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    state: SamplingState
    arrival: int
    # The call this request is one sequence of (GenerateRequest.group), "" for its own.
    group: str = ""
    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    kv_len: int = 0
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    last_node: RadixNode | None = None
    prompt_cached_tokens: int = 0  # prefix-cache hit of the first admission, reported to the caller
    emitted: int = 0  # output tokens already returned to the caller
    # One TokenLogprobs per output token when the request asked (SamplingParams.logprobs).
    output_logprobs: list = field(default_factory=list)
    # One entry per prompt token (the first stays None) when the prompt is scored
    # (SamplingParams.prompt_logprobs); sent with the first output, then dropped.
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    # Largest prefill chunk this request may run, None for no limit of its own: halved
    # by the engine each time a step with its chunk as the largest runs out of memory.
    chunk_cap: int | None = None
    # Slot in a hybrid model's state pool while admitted (engine.kvcache.state_pool), else None.
    state_slot: int | None = None
    # Ring pages of the sliding-window layers while admitted, when they keep only their
    # window (engine.kvcache.ring): logical page j lives in ring[j % len(ring)]; else empty.
    ring: list[int] = field(default_factory=list)
    oom_retries: int = 0  # same-size retries after an OOM it faced alone, since its last good step

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_len(self) -> int:
        """Tokens whose keys/values are still to compute."""
        return self.total_len - self.kv_len
