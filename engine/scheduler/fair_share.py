"""One call's sequences never hold every decode slot while another call waits.

A call of several sequences (OpenAI's ``n``, a text completion's list of prompts) sends
them as requests of one group (:attr:`engine.wire.messages.GenerateRequest.group`). A
call may ask for up to 128 sequences, twice the default ``max_running_requests``, so
first come, first served would let one such call fill every slot and keep a one-line
chat waiting for the whole of it. Here, while every slot is taken and a request waits
whose group holds fewer than half the slots (a new call holds none), the group holding
the most, above half, gives back its youngest sequence (preempted: recomputed later from
its prompt and output, its full pages kept in the prefix cache), one for each such
waiting request; and a waiting request of a group under half is admitted before the
queue's head. Alone, a call takes every slot. Two large calls settle at half each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from engine.scheduler.request import Request


def group_of(req: Request) -> str:
    """The call ``req`` belongs to: its group, or itself for a call of one sequence."""
    return req.group or req.request_id


def half(max_running: int) -> int:
    """The slots a group may keep while another group's request waits: half, at least one."""
    return max(1, max_running // 2)


def next_waiting(waiting: Iterable[Request], running: Sequence[Request], max_running: int) -> Request | None:
    """The waiting request to admit next: the first (in queue order) whose group holds
    fewer than :func:`half` of the slots, else the queue's head; None when nothing waits."""
    held = Counter(group_of(r) for r in running)
    cap = half(max_running)
    head = None
    for req in waiting:
        if head is None:
            head = req
        if held[group_of(req)] < cap:
            return req
    return head


def victims(running: Sequence[Request], waiting: Iterable[Request], max_running: int) -> list[Request]:
    """The running requests to preempt before this step is planned (module docstring):
    for each waiting request, in queue order, whose group holds fewer than :func:`half`
    of the slots, a free slot if one is left, else the youngest sequence of the group
    holding the most, when that is above half. ``running`` is in arrival order."""
    if not waiting or not running:
        return []
    held = Counter(group_of(r) for r in running)
    cap = half(max_running)
    if max(held.values()) <= cap:  # the common step: no call above half, nobody to preempt
        return []
    free = max_running - len(running)
    taken: list[Request] = []
    for req in waiting:
        group = group_of(req)
        if held[group] >= cap:
            continue
        if free > 0:
            free -= 1
        else:
            biggest, count = max(held.items(), key=lambda kv: kv[1], default=(None, 0))
            if count <= cap:
                break
            victim = next(r for r in reversed(running) if group_of(r) == biggest and r not in taken)
            taken.append(victim)
            held[biggest] -= 1
        held[group] += 1
    return taken
