"""Errors the engine raises to its caller (torch-free)."""

from __future__ import annotations


class RequestRejected(Exception):
    """A request that can never run, refused before it is queued.

    Attributes:
        code: OpenAI-style error code, e.g. ``"context_length_exceeded"``.
        param: the request field at fault, or None.
    """

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class PlanDoesNotFit(Exception):
    """The memory plan cannot hold one request of the minimum context.

    ``plan`` is the :class:`engine.memory.plan.MemoryPlan`; the message says what does
    not fit, by how much, and which settings fix it.
    """

    def __init__(self, plan) -> None:
        super().__init__(plan.message())
        self.plan = plan
