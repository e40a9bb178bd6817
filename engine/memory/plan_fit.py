"""Fitting a plan to the device by the knobs the engine may lower itself: the prefill
chunk (halved) and, where ``--max-running-requests`` is unset, the running requests
(the most that fit), never what a person placed (experts, layers, the context floor, a
number of requests), whose fixes the misfit message names.

A hybrid model's running requests each hold a recurrent state (tens of MiB for a
Qwen3.5/3.6 MoE: 64 of them take about 4 GiB), so on a small card they are lowered
before the chunk; a dense model's cost only their sampler rows, and are lowered last.
Where ``--max-running-requests`` is unset, a hybrid model's states also take at most
an eighth of the budget (:func:`requests_for_states`): on a 12 GiB card 64 states
would take the room of eight layers' experts, which every request's decode reads,
for concurrency a desktop rarely has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import msgspec

from engine.common.config import EngineConfig, ModelConfig
from engine.memory.plan import MIN_PREFILL_TOKENS, MemoryPlan, PlanKnobs, running_requests

# Unless --max-running-requests says otherwise, a hybrid model's state pool (its requests'
# states, the null slot, the prefix cache's checkpoints) takes at most 1/STATE_BUDGET_SHARE
# of the budget, and holds at least STATE_FLOOR_REQUESTS requests (llama-server's default
# of parallel slots) where the card fits them.
STATE_BUDGET_SHARE = 8
STATE_FLOOR_REQUESTS = 4


def fit_model_plan(planner: Callable[[PlanKnobs], MemoryPlan], knobs: PlanKnobs, config: EngineConfig,
                   mc: ModelConfig) -> tuple[MemoryPlan, PlanKnobs]:
    """:func:`fit_plan` with the rules ``config`` and the model give: running requests
    lowered only where ``--max-running-requests`` is unset, and then for a hybrid model
    first, from at most :func:`requests_for_states` (the engine and ``headroom plan``
    alike). The plan's ``requests_note`` says why its running requests are fewer than
    ``--max-running-requests``' default."""
    auto = config.max_running_requests is None
    asked = running_requests(config)
    # The states' share, from the count asked for (the knobs may hold one lowered already).
    share = (requests_for_states(planner, replace(knobs, max_running_requests=asked)).max_running_requests
             if auto and mc.is_hybrid else None)
    if share is not None:
        knobs = replace(knobs, max_running_requests=min(knobs.max_running_requests, share))
    plan, fitted = fit_plan(planner, knobs, fewer_requests=auto, fewer_requests_first=mc.is_hybrid)
    if not auto or not plan.fits or fitted.max_running_requests >= asked:
        return plan, fitted
    shared = fitted.max_running_requests == share
    why = (f"the linear-attention states take at most 1/{STATE_BUDGET_SHARE} of the budget" if shared else
           "the card cannot hold more" + (" and their linear-attention states" if mc.is_hybrid else ""))
    note = f"not {asked}: {why}; --max-running-requests N sets the number"
    return msgspec.structs.replace(plan, requests_note=note), fitted


def requests_for_states(planner: Callable[[PlanKnobs], MemoryPlan], knobs: PlanKnobs) -> PlanKnobs:
    """``knobs`` with the most running requests, up to ``knobs.max_running_requests``,
    whose state pool (each request's state, the null slot and the prefix cache's
    checkpoints, :attr:`PlanKnobs.state_checkpoints`) takes at most
    1/:data:`STATE_BUDGET_SHARE` of the plan's budget, and never fewer than
    :data:`STATE_FLOOR_REQUESTS`. Unchanged for a model without states."""
    plan = planner(knobs)
    per = plan.state_bytes_per_request
    share = max(plan.budget_bytes, 0) // STATE_BUDGET_SHARE
    n = knobs.max_running_requests
    while per and n > STATE_FLOOR_REQUESTS:
        tried = replace(knobs, max_running_requests=n)
        if (n + 1 + tried.state_checkpoints) * per <= share:
            break
        n -= 1
    return replace(knobs, max_running_requests=n)


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
