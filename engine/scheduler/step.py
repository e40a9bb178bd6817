"""One planned step of the scheduler: each request's share (:class:`StepItem`) and the
plan (:class:`StepPlan`) the model runner turns into a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler.request import Request


@dataclass
class StepItem:
    """One request's share of a step: feed ``all_ids[start:start + num_tokens]``."""

    req: Request
    start: int
    num_tokens: int
    new_pages: list[int]
    admitted: bool  # went from waiting to running in this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last token, so the step samples for it."""
        return self.start + self.num_tokens == self.req.total_len

    @property
    def scores(self) -> bool:
        """Whether this chunk's prompt tokens are scored (the request wants its prompt's
        logprobs): the step returns logits at all its rows."""
        return self.req.sampling.prompt_logprobs is not None and self.start < len(self.req.prompt_ids)


@dataclass
class StepPlan:
    items: list[StepItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return all(it.num_tokens == 1 and not it.admitted and not it.scores for it in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)
