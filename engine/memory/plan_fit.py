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

from engine.common.config import EngineConfig, ModelConfig
from engine.memory.plan import MIN_PREFILL_TOKENS, MemoryPlan, PlanKnobs


def fit_model_plan(planner: Callable[[PlanKnobs], MemoryPlan], knobs: PlanKnobs, config: EngineConfig,
                   mc: ModelConfig) -> tuple[MemoryPlan, PlanKnobs]:
    """:func:`fit_plan` with the rules ``config`` and the model give: running requests
    lowered only where ``--max-running-requests`` is unset, and first for a hybrid
    model (the engine and ``headroom plan`` alike)."""
    return fit_plan(planner, knobs, fewer_requests=config.max_running_requests is None,
                    fewer_requests_first=mc.is_hybrid)


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
        return fewer
    tried = knobs
    while not plan.fits and tried.max_prefill_tokens > MIN_PREFILL_TOKENS:
        tried = replace(tried, max_prefill_tokens=max(tried.max_prefill_tokens // 2, MIN_PREFILL_TOKENS))
        plan = planner(tried)
    if plan.fits:
        return plan, tried
    if fewer_requests and (fewer := most_requests_that_fit(planner, tried)) is not None:
        return fewer
    return first, knobs


def most_requests_that_fit(planner: Callable[[PlanKnobs], MemoryPlan],
                           knobs: PlanKnobs) -> tuple[MemoryPlan, PlanKnobs] | None:
    """The plan and ``knobs`` with the most running requests below
    ``knobs.max_running_requests`` that fit (what fits only falls as requests rise: a
    binary search), None when even one request does not."""
    if knobs.max_running_requests <= 1:
        return None
    best = replace(knobs, max_running_requests=1)
    best_plan = planner(best)
    if not best_plan.fits:
        return None
    high = knobs.max_running_requests - 1
    while best.max_running_requests < high:
        mid = replace(knobs, max_running_requests=(best.max_running_requests + high + 1) // 2)
        plan = planner(mid)
        if plan.fits:
            best, best_plan = mid, plan
        else:
            high = mid.max_running_requests - 1
    return best_plan, best
