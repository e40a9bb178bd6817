"""A reasoning model's thinking block kept within its budget of tokens.

A request whose :class:`~engine.wire.messages.SamplingParams` carries ``thinking`` (a
:class:`~engine.wire.messages.ThinkingBudget`) gets a :class:`ThinkingTracker` on its
sampling state. The tracker follows the request's tokens as they are appended: the
block opens at the start (the prompt opened it) or where the sequence writes the
budget's ``open_ids``, and closes where it writes ``close_ids``. Once the sequence has
written ``tokens`` tokens inside its block without closing it, :meth:`ThinkingTracker.forced`
names the next token of the close: the sampler makes it the only token the row can
take (:func:`apply_forced`), one step per token of the close, and the answer goes on
after it as the model continues. A close the model has begun is completed rather than
started over. Tags are matched on token ids, as the service tokenized them: a model
that spells ``</think>`` in other tokens (possible where the tag is not one special
token) is not seen closing, so its block ends where the budget runs out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.wire.messages import ThinkingBudget


def _ends_with(tail: list[int], ids: tuple[int, ...]) -> bool:
    return bool(ids) and len(tail) >= len(ids) and tuple(tail[-len(ids) :]) == ids


class ThinkingTracker:
    """Where one sequence stands in its thinking block (see the module docstring).

    Attributes:
        inside: the sequence is writing its block now.
        ended: its block was closed (by the model or forced); nothing more is tracked.
        written: tokens written inside the block so far (a close's own tokens included).
    """

    def __init__(self, budget: ThinkingBudget) -> None:
        if budget.tokens < 0 or not budget.close_ids:
            raise ValueError(
                f"a thinking budget needs tokens >= 0 and close ids, got {budget.tokens}, "
                f"{list(budget.close_ids)}"
            )
        self.budget = budget
        self.inside = not budget.open_ids
        self.ended = False
        self.written = 0
        self._tail: list[int] = []
        self._keep = max(len(budget.open_ids), len(budget.close_ids))

    def forced(self) -> int | None:
        """The token the sequence must write next (the close, once the budget is
        spent), or None when it is free."""
        if not self.inside or self.written < self.budget.tokens:
            return None
        close = self.budget.close_ids
        # The longest start of the close the sequence has already written.
        begun = next(
            (k for k in range(len(close) - 1, 0, -1) if tuple(self._tail[-k:]) == close[:k]), 0
        )
        return close[begun]

    def append(self, token_id: int) -> None:
        """Follow one token the sequence wrote."""
        if self.ended:
            return
        self._tail = [*self._tail, token_id][-self._keep :]
        if not self.inside:
            if _ends_with(self._tail, self.budget.open_ids):
                self.inside = True
                self._tail = []
            return
        self.written += 1
        if _ends_with(self._tail, self.budget.close_ids):
            self.inside = False
            self.ended = True


def forced_tokens(trackers: Sequence[ThinkingTracker | None]) -> list[int | None]:
    """Each row's forced token (:meth:`ThinkingTracker.forced`), None for a free row."""
    return [None if t is None else t.forced() for t in trackers]


def apply_forced(logits: torch.Tensor, forced: Sequence[int | None]) -> torch.Tensor:
    """``logits`` with each forced row's tokens at ``-inf`` but its forced one (which
    keeps its logit, so the row's logprobs give it probability 1); ``logits`` itself
    when no row is forced, else a new float32 tensor.

    Args:
        logits: ``[B, V]`` float.
        forced: ``B`` entries, a row's forced token id or None.
    """
    rows = [(i, t) for i, t in enumerate(forced) if t is not None]
    if not rows:
        return logits
    x = logits.float().clone()
    for i, token in rows:
        keep = x[i, token].clone()
        x[i].fill_(float("-inf"))
        x[i, token] = keep if torch.isfinite(keep) else 0.0
    return x
