"""What the engine does when a step runs out of device memory.

The plan makes request-time OOMs rare, not impossible: another process can take memory
after the plan was made (memory taken after start), or a transient was not budgeted. A step that
raises ``torch.OutOfMemoryError`` has changed nothing yet (the scheduler commits only
after the forward and sampling succeed), so :meth:`OomRecovery.recover` rolls it back
exactly, gives the allocator's cached blocks back to the device, and makes the next
step smaller:

1. Engine-wide: the prefill chunk cap is halved, down to ``min(256, cap)``, and a
   :class:`engine.wire.messages.ReplanWanted` is queued (the plan no longer matches the
   device).
2. A step with prefill chunks (and the OOM in its forward): the request with the
   largest chunk gets its own chunk cap halved, down to a floor of
   ``max(16, page_size)`` tokens.
3. Otherwise (chunks at the floor, a pure decode step, or an OOM in sampling): the
   youngest request of the step (of those that sample, for a sampling OOM) is preempted
   (pages freed, requeued for recompute) and the number of running requests is held one
   below what the failed step ran, so it is not readmitted straight into the same step.
4. A request that faces the OOM alone and already at its smallest size is run again as
   is up to ``MAX_SAME_SIZE_RETRIES`` times (an OOM can be transient: the cache was just
   emptied, another process may let go), then fails alone with ``out_of_memory``.

Why fail only alone: an OOM in a batch says the batch did not fit, not which request
is to blame. Shrinking the largest chunk, then thinning the batch youngest first, ends
either with a step that fits or with one request that cannot run even by itself: that
request, and only that one, fails. Every other request of a failed step was rolled back
and simply runs again; its output is the one it would have had without the fault.

The floors, argued: a request's chunk below ``max(16, page_size)`` tokens saves nothing
worth a retry (it still takes a whole page, and its activations are those of 16 decode
tokens, which every step of a full batch already needs). The engine-wide cap stops at
256 tokens because decodes count against it (a cap below the running batch would starve
admission), and a 256-token chunk's activations are small beside weights and KV pages on
any model this engine serves: further cuts are made per request.

The running-request hold is lifted by one after every ``HOLD_RELEASE_STEPS`` steps in a
row that succeed: slow enough that a preempted request is not thrown straight back into
a step that cannot fit, fast enough to refill the batch when the memory comes back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.common.units import count_of
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import Scheduler, StepItem, StepPlan
from engine.wire.messages import (
    OOM_FAILED,
    OOM_PHASE_DECODE,
    OOM_PHASE_PREFILL,
    OOM_PHASE_SAMPLE,
    OOM_PREEMPTED,
    OOM_RETRY,
    OOM_RETRY_SMALLER_CHUNK,
    EngineEvent,
    OomEvent,
    ReplanWanted,
)

log = logging.getLogger("headroom.engine")

ERROR_CODE = "out_of_memory"
REQUEST_CHUNK_FLOOR_TOKENS = 16
ENGINE_CHUNK_FLOOR_TOKENS = 256
MAX_SAME_SIZE_RETRIES = 2
HOLD_RELEASE_STEPS = 16


def oom_summary(text: str) -> str:
    """The first two sentences of an allocator message ("CUDA out of memory. Tried to
    allocate 2.00 GiB"), without the advice that follows."""
    return ". ".join(text.strip().split(". ")[:2]).rstrip(".")[:240]


@dataclass
class OomRecovery:
    """OOM policy and its state for one engine (see the module docstring).

    Args:
        scheduler: whose plan is rolled back and whose live limits are lowered.
        page_size: tokens per KV page (sets the per-request chunk floor).
        device: where the model runs; on CUDA the allocator's cache is emptied.
    """

    scheduler: Scheduler
    page_size: int
    device: torch.device
    events: list[OomEvent] = field(default_factory=list)
    replan: ReplanWanted | None = None
    retrying: set[Request] = field(default_factory=set)  # requests with oom_retries > 0
    good_steps: int = 0  # successful steps in a row since the last OOM or hold release
    oom_count: int = 0

    @property
    def chunk_floor(self) -> int:
        return max(REQUEST_CHUNK_FLOOR_TOKENS, self.page_size)

    def recover(self, plan: StepPlan, stage: str, error_text: str) -> None:
        """Undo ``plan``, which raised ``torch.OutOfMemoryError`` in ``stage``
        (``"forward"`` or ``"sample"``), and act on one request (see the module
        docstring). A request that fails is ended through ``Scheduler.fail`` and is
        reported by the engine with the step's outputs."""
        sched = self.scheduler
        # Read the step before rollback changes phases and page lists.
        prefill = [it for it in plan.items if it.req.phase is Phase.PREFILL]
        if stage == "sample":
            phase = OOM_PHASE_SAMPLE
        else:
            phase = OOM_PHASE_PREFILL if prefill else OOM_PHASE_DECODE
        tokens = plan.num_tokens
        running_at_step = len(sched.running)
        sched.rollback(plan)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.oom_count += 1
        self.good_steps = 0
        detail = oom_summary(error_text)

        old_cap = sched.max_prefill_tokens
        sched.max_prefill_tokens = max(min(ENGINE_CHUNK_FLOOR_TOKENS, old_cap), old_cap // 2)
        self.replan = ReplanWanted(
            reason=f"out of memory in a {phase} step of {tokens} tokens ({detail}); "
            f"prefill chunk cap {old_cap} -> {sched.max_prefill_tokens} tokens",
            new_max_prefill_tokens=sched.max_prefill_tokens,
        )

        def event(req: Request, action: str, message: str) -> None:
            log.warning(
                "out of memory (%s, %d tokens): %s %s: %s",
                phase,
                tokens,
                req.request_id,
                action,
                message,
            )
            self.events.append(
                OomEvent(
                    request_id=req.request_id,
                    phase=phase,
                    tokens_in_step=tokens,
                    action=action,
                    message=message,
                )
            )

        if phase == OOM_PHASE_PREFILL:
            big = max(prefill, key=lambda it: (it.num_tokens, it.req.arrival))
            if big.num_tokens > self.chunk_floor:
                req = big.req
                req.chunk_cap = max(self.chunk_floor, big.num_tokens // 2)
                event(
                    req,
                    OOM_RETRY_SMALLER_CHUNK,
                    f"a prefill chunk of {big.num_tokens} tokens did not fit ({detail}); "
                    f"retrying with chunks of at most {req.chunk_cap} tokens",
                )
                return
        suspects = (
            [it for it in plan.items if it.samples] if phase == OOM_PHASE_SAMPLE else plan.items
        )
        if len(suspects) > 1:
            victim = max(suspects, key=lambda it: it.req.arrival).req
            sched.preempt(victim)
            sched.max_running_requests = max(
                1, min(sched.max_running_requests, running_at_step - 1)
            )
            event(
                victim,
                OOM_PREEMPTED,
                f"the step of {count_of(len(plan.items), 'request')} did not fit ({detail}); the youngest "
                f"waits to be recomputed; running requests held at {sched.max_running_requests}",
            )
            return
        self._retry_or_fail(suspects[0], phase, detail, event)

    def _retry_or_fail(self, it: StepItem, phase: str, detail: str, event) -> None:
        req = it.req
        req.oom_retries += 1
        self.retrying.add(req)
        if phase == OOM_PHASE_PREFILL:
            what = (
                f"a prefill chunk of {it.num_tokens} tokens (chunk cap {req.chunk_cap or it.num_tokens}, "
                f"the floor is {self.chunk_floor}; {req.total_len - it.start} of its "
                f"{req.total_len} tokens still to compute)"
            )
        elif phase == OOM_PHASE_DECODE:
            what = f"decoding one token at a context of {it.start + 1} tokens"
        else:
            what = f"sampling its next token at a context of {req.total_len} tokens"
        if req.oom_retries <= MAX_SAME_SIZE_RETRIES:
            event(
                req,
                OOM_RETRY,
                f"{what} did not fit even alone ({detail}); retry {req.oom_retries} "
                f"of {MAX_SAME_SIZE_RETRIES}",
            )
            return
        message = (
            f"out of device memory: {what} does not fit even with no other request in the "
            f"step, after {MAX_SAME_SIZE_RETRIES} retries ({detail}). The device has less free "
            "memory than the engine planned for (another process may be using it); retry "
            "later, or with a shorter prompt"
        )
        self.retrying.discard(req)
        self.scheduler.fail(req, ERROR_CODE, message)
        event(req, OOM_FAILED, message)

    def after_good_step(self, plan: StepPlan) -> None:
        """Bookkeeping after a step that committed: requests in it start their retry count
        afresh; the running-request hold is lifted step by step."""
        if self.retrying:
            for it in plan.items:
                if it.req in self.retrying:
                    it.req.oom_retries = 0
                    self.retrying.discard(it.req)
            # Aborted or finished since: nothing left to count.
            self.retrying = {r for r in self.retrying if r.phase is not Phase.FINISHED}
        sched = self.scheduler
        if sched.max_running_requests < sched.config.max_running_requests:
            self.good_steps += 1
            if self.good_steps >= HOLD_RELEASE_STEPS:
                sched.max_running_requests += 1
                self.good_steps = 0

    def drain_events(self) -> list[EngineEvent]:
        """OOM events since the last call, in order, then at most one ReplanWanted (the
        latest: it carries the current cap)."""
        out: list[EngineEvent] = list(self.events)
        self.events.clear()
        if self.replan is not None:
            out.append(self.replan)
            self.replan = None
        return out
