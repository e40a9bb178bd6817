"""Reasoning control: whether a thinking model thinks, and for how many tokens.

Each API says it its own way, and each becomes the same two facts of the one
:class:`~service.api.request.GenerationRequest`: ``thinking`` (on, off, or None: the
template's default) and ``thinking_budget`` (the most reasoning tokens, None: no
limit):

- OpenAI's ``reasoning_effort`` (chat completions) and ``reasoning.effort``
  (Responses): ``none`` and ``minimal`` turn thinking off; ``low``, ``medium`` and
  ``high`` turn it on with the budgets of :data:`EFFORT_BUDGETS`.
- Ollama's ``think``: ``false`` off, ``true`` on (no limit), ``"low"``, ``"medium"``,
  ``"high"`` as OpenAI's efforts.

An effort of low, medium or high also reaches the template as ``reasoning_effort``
(gpt-oss's template writes it into its system message).

Thinking off is the template's ``enable_thinking: false`` (the template closes an
empty block in the prompt), backed by a budget of 0: a model that opens a block anyway
has it closed at once. A budget is enforced in the engine
(:mod:`engine.sampling.thinking`). Asking a model whose template cannot think to
think is a 400 (:func:`check_thinking`); asking it not to (an effort that is off, a
budget of 0) is always accepted. A budget sent beside an effort replaces the effort's
own, and one that contradicts it (off with a budget above 0, on with a budget of 0) is
a 400 naming both (:func:`budget_thinking`).
"""

from __future__ import annotations

from typing import Any

from engine.common.clip import clip
from service.api.reasoning import template_thinks
from service.common.errors import invalid

# Reasoning tokens per effort: enough for a short check (low), a worked problem
# (medium), and no cap (high).
EFFORT_BUDGETS: dict[str, int | None] = {"low": 1024, "medium": 4096, "high": None}
EFFORTS_OFF = ("none", "minimal")
# Budgets above this (the wire's largest integer) no context reaches: no limit.
MAX_BUDGET = 2**63 - 1


def effort_thinking(effort: str | None, param: str) -> tuple[bool | None, int | None]:
    """``(thinking, thinking_budget)`` of OpenAI's reasoning effort (None: not set).

    Raises:
        APIError: 400 naming ``param`` for an effort that is none of
            none/minimal/low/medium/high.
    """
    if effort is None:
        return None, None
    if not isinstance(effort, str):
        raise invalid(f"{param} must be a string", param)
    if effort in EFFORTS_OFF:
        return False, None
    if effort in EFFORT_BUDGETS:
        return True, EFFORT_BUDGETS[effort]
    raise invalid(
        f"{param} must be one of none, minimal, low, medium, high; got {effort!r}", param
    )


def ollama_thinking(think: Any) -> tuple[bool | None, int | None]:
    """``(thinking, thinking_budget)`` of Ollama's ``think`` (None: not set).

    Raises:
        APIError: 400 ``think`` for anything but a boolean or low/medium/high.
    """
    if think is None or isinstance(think, bool):
        return think, None
    if isinstance(think, str) and think in EFFORT_BUDGETS:
        return True, EFFORT_BUDGETS[think]
    raise invalid('think must be true, false, "low", "medium" or "high"', "think")


def with_thinking(
    template_kwargs: dict[str, Any] | None, thinking: bool | None, effort: Any = None
) -> dict[str, Any] | None:
    """The template variables with ``enable_thinking`` set from ``thinking``, and
    ``reasoning_effort`` from an ``effort`` of low, medium or high (the client's own
    variables win; None and no effort: unchanged)."""
    ours: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
    if isinstance(effort, str) and effort in EFFORT_BUDGETS:
        ours["reasoning_effort"] = effort
    if not ours:
        return template_kwargs
    return {**ours, **(template_kwargs or {})}


def budget_thinking(
    thinking: bool | None, budget: int, effort_param: str, budget_param: str
) -> tuple[bool | None, int]:
    """``(thinking, thinking_budget)`` of an effort's ``thinking`` (None: no effort
    set) and an explicit ``budget`` in tokens, which replaces the effort's own: a
    budget of 0 is thinking off.

    Raises:
        APIError: 400 naming ``budget_param`` (its message names both fields) when
            they contradict each other: an effort that turns thinking off with a
            budget above 0, or one that turns it on with a budget of 0.
    """
    if thinking is False and budget > 0:
        raise invalid(f"{effort_param} turns thinking off, but {budget_param} asks for {budget} tokens of it; "
                      "send one of them", budget_param)
    if thinking is True and budget == 0:
        raise invalid(f"{effort_param} turns thinking on, but {budget_param} 0 turns it off; "
                      "send one of them", budget_param)
    return (False if budget == 0 else thinking), budget


def thinking_asked(thinking: bool | None, budget: int | None) -> bool:
    """Whether a call asks the model to think: on, or a budget above 0 without saying
    on (a budget of 0 asks for no thinking)."""
    return thinking if thinking is not None else bool(budget)


def check_thinking(thinking: bool | None, budget: int | None, chat_template: str | None, model: str, param: str) -> None:
    """Refuse thinking asked of a model whose template writes no thinking block.

    Raises:
        APIError: 400 naming ``param``: ``"<model>" does not support thinking``.
    """
    if thinking_asked(thinking, budget) and not template_thinks(chat_template):
        raise invalid(f'"{clip(model)}" does not support thinking', param)


def budget_tokens(thinking: bool | None, budget: int | None) -> int | None:
    """The reasoning tokens a sequence may write: 0 when thinking is off, else
    ``budget`` (None: no limit, as is a budget above :data:`MAX_BUDGET`)."""
    if thinking is False:
        return 0
    return None if budget is not None and budget > MAX_BUDGET else budget
