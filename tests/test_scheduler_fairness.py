"""Chunked prefill and a short prompt behind a long one: the scheduler's plans, step by
step (no model): a short chat that arrives while a long prompt is prefilling gets its
whole prompt into the next step, beside the long prompt's chunk and every decode,
instead of waiting for all of the long prompt's chunks."""

from __future__ import annotations

import torch

from engine.kvcache.allocator import PageAllocator
from engine.sampling.state import SamplingState
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.wire.messages import SamplingParams

CHUNK = 512


def _scheduler(radix=None) -> Scheduler:
    config = SchedulerConfig(page_size=16, max_running_requests=8, max_prefill_tokens=CHUNK,
                             max_context_tokens=16384)
    return Scheduler(config, PageAllocator(2048), radix)


def _req(rid: str, n: int, arrival: int, new_tokens: int = 4) -> Request:
    sampling = SamplingParams(max_new_tokens=new_tokens)
    prompt = list(range(1, n + 1))
    return Request(request_id=rid, prompt_ids=prompt, sampling=sampling,
                   state=SamplingState(sampling, prompt, 8192, torch.device("cpu")), arrival=arrival)


def _run(sched: Scheduler, plan) -> None:
    sched.commit(plan, {it.req.request_id: 7 for it in plan.items if it.samples})


def test_a_short_prompt_is_admitted_beside_a_long_prefill():
    sched = _scheduler()
    sched.add(_req("long", 4000, 0))
    _run(sched, sched.schedule())  # the long prompt's first chunk
    sched.add(_req("short", 40, 1))
    sched.add(_req("short2", 80, 2))
    plan = sched.schedule()
    by_id = {it.req.request_id: it for it in plan.items}
    # Both short prompts whole (120 tokens, within a quarter of the chunk), the long
    # prompt's chunk the rest of the budget.
    assert by_id["short"].num_tokens == 40 and by_id["short"].samples
    assert by_id["short2"].num_tokens == 80 and by_id["short2"].samples
    assert by_id["long"].num_tokens == CHUNK - 120
    assert sum(it.num_tokens for it in plan.items) == CHUNK
    _run(sched, plan)
    # Next step: the short ones decode, the long one keeps prefilling.
    plan = sched.schedule()
    by_id = {it.req.request_id: it for it in plan.items}
    assert by_id["short"].num_tokens == by_id["short2"].num_tokens == 1
    assert by_id["long"].num_tokens == CHUNK - 2


def test_a_short_prompt_admitted_beside_the_end_of_a_long_prefill_is_planned_once():
    """The long prompt's last chunk leaves budget over: the short prompt, admitted whole
    before it, must not be planned a second time as a running prefill (its first token
    would be sampled twice)."""
    sched = _scheduler()
    sched.add(_req("long", CHUNK + 88, 0))
    _run(sched, sched.schedule())
    sched.add(_req("short", 40, 1))
    plan = sched.schedule()
    assert sorted((it.req.request_id, it.num_tokens) for it in plan.items) == [("long", 88), ("short", 40)]
    _run(sched, plan)
    assert [r.output_ids for r in sched.running] == [[7], [7]]


def test_a_long_prompt_behind_a_long_prefill_waits_and_the_long_one_keeps_most_of_a_step():
    sched = _scheduler()
    sched.add(_req("first", 4000, 0))
    _run(sched, sched.schedule())
    sched.add(_req("second", 3000, 1))  # longer than a quarter chunk: waits its turn
    sched.add(_req("short", 20, 2))  # behind it in the queue: arrival order is kept
    plan = sched.schedule()
    assert [it.req.request_id for it in plan.items] == ["first"]
    assert plan.items[0].num_tokens == CHUNK
    # Short prompts never take more than a quarter of a step from a running prefill.
    sched = _scheduler()
    sched.add(_req("long", 4000, 0))
    _run(sched, sched.schedule())
    for i in range(6):
        sched.add(_req(f"s{i}", 60, 1 + i))
    plan = sched.schedule()
    shorts = [it for it in plan.items if it.req.request_id.startswith("s")]
    assert len(shorts) == 2 and sum(it.num_tokens for it in shorts) <= CHUNK // 4
    assert next(it for it in plan.items if it.req.request_id == "long").num_tokens == CHUNK - 120


def test_without_a_running_prefill_the_queue_is_served_in_order():
    sched = _scheduler()
    sched.add(_req("a", 300, 0))
    sched.add(_req("b", 50, 1))
    plan = sched.schedule()
    assert [(it.req.request_id, it.num_tokens) for it in plan.items] == [("a", 300), ("b", 50)]
    assert all(it.req.phase is Phase.PREFILL for it in plan.items)


def test_two_prefills_short_of_pages_do_not_stall_each_other():
    """Two long prompts prefilling at once (the second admitted beside the first's chunk
    that a chunk cap cut short) over a pool of 24 pages that holds neither whole: once
    the free pages are gone neither can grow, so the youngest goes back to waiting and
    the oldest finishes its prefill and decodes; later the youngest runs too. Every
    step plans something."""
    config = SchedulerConfig(page_size=16, max_running_requests=8, max_prefill_tokens=64, max_context_tokens=384)
    sched = Scheduler(config, PageAllocator(25), None)
    a, b = _req("a", 300, 0), _req("b", 300, 1)
    a.chunk_cap = 32  # a's chunks leave half of each step's budget: b is admitted beside it
    sched.add(a)
    sched.add(b)
    preempted, finished, steps = [], set(), 0
    while sched.has_work() and steps < 200:
        plan = sched.schedule()
        assert plan is not None and plan.items, f"step {steps} planned nothing"
        preempted += [r.request_id for r in plan.preempted]
        _run(sched, plan)
        finished |= {r.request_id for r in sched.drain_ended()}
        steps += 1
    assert "b" in preempted and finished == {"a", "b"}
    assert sched.allocator.num_free == sched.allocator.num_usable


# --- one call's sequences against another call (engine.scheduler.fair_share) ------------


def _call(sched: Scheduler, group: str, n: int, arrival: int, prompt: int = 40) -> list[Request]:
    """A call of ``n`` sequences of one group, added in order."""
    reqs = []
    for i in range(n):
        req = _req(f"{group}-{i}", prompt, arrival + i, new_tokens=50)
        req.group = group
        sched.add(req)
        reqs.append(req)
    return reqs


def _steps(sched: Scheduler, count: int) -> list:
    plans = []
    for _ in range(count):
        plan = sched.schedule()
        _run(sched, plan)
        plans.append(plan)
    return plans


def test_a_call_alone_takes_every_slot():
    sched = _scheduler()
    _call(sched, "big", 12, 0)
    plans = _steps(sched, 2)
    assert len(sched.running) == 8 and len(sched.waiting) == 4
    assert all(not p.preempted for p in plans)


def test_a_chat_arriving_while_one_call_holds_every_slot_runs_in_the_next_step():
    """The call's youngest sequence goes back to waiting (its output kept, recomputed
    later); the chat is admitted in the same step, not after the whole call."""
    sched = _scheduler()
    big = _call(sched, "big", 8, 0)
    _steps(sched, 2)
    assert len(sched.running) == 8
    sched.add(_req("chat", 20, 100))
    plan = sched.schedule()
    assert [r.request_id for r in plan.preempted] == ["big-7"]
    assert "chat" in {it.req.request_id for it in plan.items}
    assert big[7].phase is Phase.WAITING and big[7].output_ids == [7, 7]
    _run(sched, plan)
    # The chat runs to its end beside the seven; the eighth waits for a slot, then
    # resumes from its prompt and output so far.
    for _ in range(4):
        _run(sched, sched.schedule())
    assert sched.requests["chat"].phase is Phase.FINISHED
    plan = sched.schedule()
    assert any(it.req is big[7] for it in plan.items) and not plan.preempted


def test_two_large_calls_settle_at_half_the_slots_each():
    sched = _scheduler()
    _call(sched, "a", 8, 0)
    _steps(sched, 1)
    _call(sched, "b", 8, 100)
    plan = sched.schedule()
    assert len(plan.preempted) == 4 and {r.group for r in plan.preempted} == {"a"}
    held = sorted(r.group for r in sched.running)
    assert held == ["a"] * 4 + ["b"] * 4
    _run(sched, plan)
    assert not sched.schedule().preempted  # settled: no more give-backs


def test_requests_of_their_own_never_preempt_each_other():
    """Single-sequence calls keep first come, first served: none holds above half."""
    sched = _scheduler()
    for i in range(10):
        sched.add(_req(f"r{i}", 20, i))
    plans = _steps(sched, 2)
    assert all(not p.preempted for p in plans)
    assert [r.request_id for r in sched.running] == [f"r{i}" for i in range(8)]
