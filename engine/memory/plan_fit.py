"""Fitting a plan to the device by the knobs the engine may lower itself: the prefill
chunk (halved) and, where ``--max-running-requests`` is unset, the running requests
(the most that fit), never what a person placed (experts, layers, the context floor, a
number of requests), whose fixes the misfit message names.

A hybrid model's running requests each hold a recurrent state (tens of MiB for a
Qwen3.5/3.6 MoE: 64 of them take about 4 GiB), so on a small card they are lowered
before the chunk; a dense model's cost only their sampler rows, and are lowered last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.memory.plan import MIN_PREFILL_TOKENS, MemoryPlan, PlanKnobs


def fit_plan(planner: Callable[[PlanKnobs], MemoryPlan], knobs: PlanKnobs, fewer_requests: bool = False,
             fewer_requests_first: bool = False) -> tuple[MemoryPlan, PlanKnobs]:
    """Plan with ``knobs``; when that cannot hold one request of ``--min-context``,
    halve the prefill chunk (floor ``MIN_PREFILL_TOKENS``) until it can, and failing
    that, with ``fewer_requests`` (``--max-running-requests`` unset), take the most
    running requests that fit at the smallest chunk. With ``fewer_requests_first`` too
    (a model with per-request states) the most running requests that fit at the
    configured chunk are taken before any halving. A plan that
    fits with a lowered context keeps its chunk: a smaller chunk slows every prompt's
    prefill and frees little where the context-long terms of the activation peak
    dominate, while a lowered context only refuses the longest prompts, and grows back
    with the pool.

    Returns:
        (the plan, the knobs it was made with). When nothing fits, the plan at the
        configured knobs (``fits`` False: its message prices the fixes) and ``knobs``.
    """
    if knobs.cpu_layers == "auto":
        # A smaller prefill chunk costs less than layers on the CPU: tried first, unsplit.
        plan, tried = fit_plan(planner, replace(knobs, cpu_layers="0"), fewer_requests, fewer_requests_first)
        if plan.fits:
            return plan, tried
    first = plan = planner(knobs)
    if plan.fits:
        return plan, knobs
    if fewer_requests and fewer_requests_first and (fewer := most_requests_that_fit(planner, knobs)) is not None:
        return planner(fewer), fewer
    tried = knobs
    while not plan.fits and tried.max_prefill_tokens > MIN_PREFILL_TOKENS:
        tried = replace(tried, max_prefill_tokens=max(tried.max_prefill_tokens // 2, MIN_PREFILL_TOKENS))
        plan = planner(tried)
    if plan.fits:
        return plan, tried
    if fewer_requests and (fewer := most_requests_that_fit(planner, tried)) is not None:
        return planner(fewer), fewer
    return first, knobs


def most_requests_that_fit(planner: Callable[[PlanKnobs], MemoryPlan], knobs: PlanKnobs) -> PlanKnobs | None:
    """``knobs`` with the most running requests below ``knobs.max_running_requests`` whose
    plan fits (what fits only falls as requests rise: a binary search), None when even
    one request does not."""
    if knobs.max_running_requests <= 1 or not planner(replace(knobs, max_running_requests=1)).fits:
        return None
    low, high = 1, knobs.max_running_requests - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if planner(replace(knobs, max_running_requests=mid)).fits else (low, mid - 1)
    return replace(knobs, max_running_requests=low)
