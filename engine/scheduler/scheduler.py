"""Continuous batching with chunked prefill over the paged KV cache.

Each step mixes every decoding request (one token each) with prefill chunks, up to
``max_prefill_tokens`` new tokens in all. A request moves
waiting -> prefill (in chunks) -> decode -> finished; preemption sends a running
request back to waiting, to be recomputed from its prompt and output so far.

The scheduler owns pages and the prefix cache; it never touches tensors. A live resize
of the KV pool goes through it too (:func:`engine.scheduler.resize.shrink_pages`): it
frees the pages above the cut and says which pages moved, and the engine copies their
contents. A step is
planned (:meth:`Scheduler.schedule`), run by the model runner, then either committed
(:meth:`Scheduler.commit`) or rolled back (:meth:`Scheduler.rollback`), so a failed
forward leaves every request exactly as it was before the step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kvcache.allocator import OutOfPages, PageAllocator
from engine.kvcache.radix import RadixCache
from engine.kvcache.ring import RingPages
from engine.scheduler import fair_share
from engine.scheduler.prefix_pages import cache_full_pages
from engine.scheduler.prefix_rings import PrefixRings
from engine.scheduler.prefix_states import PrefixStates
from engine.scheduler.request import Phase, Request
from engine.scheduler.ring_growth import grow_ring, ring_tokens
from engine.scheduler.step import StepItem, StepPlan
from engine.wire.messages import (
    ERROR_INVALID_SCHEMA,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    SCORED_CHUNK_TOKENS,
)

if TYPE_CHECKING:
    from engine.kvcache.state_pool import StatePool


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_prefill_tokens``: new tokens per step (chunk cap). ``max_context_tokens``:
    the most tokens (prompt + output) one request may hold."""

    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    max_context_tokens: int
    eos_token_ids: tuple[int, ...] = ()


class Scheduler:
    """Admission, batching, page accounting and prefix caching for one engine.

    ``max_prefill_tokens``, ``max_running_requests`` and ``max_context_tokens`` are the
    live limits, starting at the config's values: the engine lowers the first two after
    an out-of-memory step, a replan may set the chunk cap, and a KV pool resize moves the
    context limit; ``config`` keeps what was asked for at the start.
    """

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, radix: RadixCache | None,
                 states: StatePool | None = None, ring: RingPages | None = None) -> None:
        """``states``, ``ring``: a hybrid model's state pool, the ring pool of sliding
        layers that keep only their window (:mod:`engine.kvcache.ring`; no chunk is longer
        than it was sized for); a request holds a slot from admission for as long as it
        holds pages (``Request.state_slot``), and ring pages as its pages grow, at most a
        ring's (``Request.ring``, :mod:`engine.scheduler.ring_growth`).

        With a prefix cache, each keeps checkpoints at page boundaries beside the cached
        pages (:mod:`engine.scheduler.prefix_states`, :mod:`engine.scheduler.prefix_rings`).
        """
        self.ring = ring
        self.config = config
        self.states = states
        self.max_prefill_tokens = config.max_prefill_tokens
        self.max_running_requests = config.max_running_requests
        self.max_context_tokens = config.max_context_tokens
        self.allocator = allocator
        self.radix = radix
        # A hybrid model's prefix cache keeps its states at page boundaries too, and one
        # of sliding layers that keep only their window their ring's last window.
        self.prefix_states = None
        if states is not None and radix is not None:
            self.prefix_states = PrefixStates(states, radix, config.page_size)
        elif ring is not None and radix is not None:
            self.prefix_states = PrefixRings(ring, radix, config.page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # prefill and decode, in arrival order
        self.requests: dict[str, Request] = {}
        self.finished_count = 0
        self.aborted_count = 0
        self.failed_count = 0
        self._ended: list[Request] = []  # finished since the last drain, to report

    # -- requests in and out ------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """End a request in any phase; its pages are released now."""
        req = self.requests.get(request_id)
        if req is None or req.phase is Phase.FINISHED:
            return
        self._finish(req, FINISH_ABORT)
        self.aborted_count += 1

    def finish(self, req: Request, reason: str) -> None:
        """End a request in any phase with ``reason`` (e.g. ``"length"`` when a smaller KV
        pool no longer leaves it room); its pages are released now."""
        if req.phase is Phase.FINISHED:
            return
        self._finish(req, reason)
        self.finished_count += 1

    def fail(self, req: Request, code: str, message: str) -> None:
        """End a request with an error (e.g. ``out_of_memory``)."""
        req.error_code, req.error_message = code, message
        self._finish(req, "error")
        self.failed_count += 1

    def drain_ended(self) -> list[Request]:
        """Requests that ended since the last call (finished, aborted or failed)."""
        out, self._ended = self._ended, []
        for req in out:
            self.requests.pop(req.request_id, None)
        return out

    def has_work(self) -> bool:
        """Anything waiting, running, or ended but not yet reported."""
        return bool(self.waiting or self.running or self._ended)

    # -- planning -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step: all decodes, then prefill chunks within the token budget:
        first the waiting requests at the head of the queue whose whole prompt fits in a
        quarter of the budget (:meth:`_admit_short`), then the running prefills, then
        further waiting requests.

        Two or more running requests mid-prefill, none able to grow (each waiting for
        pages the others hold), would plan nothing for ever: the youngest goes back to
        waiting, as a decode short of pages preempts, and the step is planned again.

        Returns None when nothing can run.
        """
        plan = StepPlan()
        for victim in fair_share.victims(self.running, self.waiting, self.max_running_requests):
            plan.preempted.append(victim)
            self._preempt(victim)
        self._fill(plan)
        while not plan.items and len(self.running) > 1 and all(r.phase is Phase.PREFILL for r in self.running):
            plan.preempted.append(victim := self.running[-1])
            self._preempt(victim)
            self._fill(plan)
        return plan if plan.items else None

    def _fill(self, plan: StepPlan) -> None:
        """Plan the step into ``plan`` (see :meth:`schedule`)."""
        budget = self.max_prefill_tokens
        for req in list(self.running):
            if req.phase is not Phase.DECODE or req not in self.running:
                continue
            item = self._plan_decode(req, plan)
            if item is not None:
                plan.items.append(item)
                budget -= 1
        budget -= self._admit_short(plan, budget)
        planned = {id(it.req) for it in plan.items}  # a request takes at most one item a step
        for req in list(self.running):
            if req.phase is Phase.PREFILL and budget > 0 and req in self.running and id(req) not in planned:
                item = self._plan_chunk(req, budget, admitted=False)
                if item is None:
                    break
                plan.items.append(item)
                budget -= item.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self._next_waiting()
            item = self._admit(req, budget)
            if item is None:
                break
            self.waiting.remove(req)
            self.running.append(req)
            plan.items.append(item)
            budget -= item.num_tokens

    def _admit_short(self, plan: StepPlan, budget: int) -> int:
        """While a long prompt is prefilling, admit the short prompts waiting at the head
        of the queue into this step (whole prompts, a quarter of ``budget`` in all), so
        a short chat's first token does not wait for every chunk of a long prompt that
        came before it; the long prompt keeps at least three quarters of each step.
        Returns the tokens planned."""
        if not any(r.phase is Phase.PREFILL for r in self.running):
            return 0
        share = budget // 4
        planned = 0
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self._next_waiting()
            if req.pending_len > share - planned:
                break
            item = self._admit(req, share - planned)
            if item is None:
                break
            self.waiting.remove(req)
            self.running.append(req)
            plan.items.append(item)
            planned += item.num_tokens
        return planned

    def _next_waiting(self) -> Request:
        """The waiting request to admit next (:func:`engine.scheduler.fair_share.next_waiting`)."""
        return fair_share.next_waiting(self.waiting, self.running, self.max_running_requests)

    def _plan_decode(self, req: Request, plan: StepPlan) -> StepItem | None:
        while True:
            try:
                pages = self._alloc_for(req, req.kv_len + 1)
                return StepItem(req, req.kv_len, 1, pages, admitted=False)
            except OutOfPages:
                victim = self._youngest_running(exclude_planned=plan)
                if victim is None:
                    raise
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    return None

    def _plan_chunk(self, req: Request, budget: int, *, admitted: bool) -> StepItem | None:
        n = min(req.pending_len, budget)
        if req.chunk_cap is not None:
            n = min(n, req.chunk_cap)
        if self.prefix_states is not None:
            n = self.prefix_states.chunk_tokens(req, n)
        if req.sampling.prompt_logprobs is not None and req.kv_len < len(req.prompt_ids):
            n = min(n, SCORED_CHUNK_TOKENS)  # each scored token makes a row of logits
        if self.ring is not None:
            n = min(n, self.ring.ring.max_chunk)  # the ring holds the window and one such chunk
        try:
            pages = self._alloc_for(req, req.kv_len + n)
        except OutOfPages:
            # Take what fits: a smaller chunk still makes progress.
            can = (self.allocator.num_free + self._evictable()) * self.config.page_size
            n = min(n, len(req.pages) * self.config.page_size + can - req.kv_len)
            if self.ring is not None and (reach := ring_tokens(self.ring, req)) is not None:
                n = min(n, reach - req.kv_len)
            if n <= 0:
                return None
            pages = self._alloc_for(req, req.kv_len + n)
        return StepItem(req, req.kv_len, n, pages, admitted=admitted)

    def _admit(self, req: Request, budget: int) -> StepItem | None:
        if self.states is not None:
            if self.states.num_free == 0:
                self._release(req)
                return None
            req.state_slot = self.states.alloc()
        if self.radix is not None and req.sampling.prompt_logprobs is None:
            # Leave at least one token to compute: the step needs its logits. A prompt
            # whose logprobs are wanted is computed whole: no cached prefix.
            pages, node = self.radix.match_prefix(req.all_ids[: req.total_len - 1])
            self.radix.lock(node)
            req.pages, req.last_node = list(pages), node
            req.kv_len = req.cached_len = len(pages) * self.config.page_size
            if not req.output_ids:
                req.prompt_cached_tokens = req.cached_len
            if self.ring is not None:
                try:  # the ring covers the cached prefix, which the checkpoint fills
                    grow_ring(self.ring, req, [], self.allocator, self.running, self.radix)
                except OutOfPages:
                    node = None
                if node is None or (req.cached_len and node.state is None):  # short, or its checkpoint dropped
                    self._release(req)
                    return None
            if self.prefix_states is not None:
                self.prefix_states.restore(req, node)
        req.phase = Phase.PREFILL
        item = self._plan_chunk(req, budget, admitted=True)
        if item is None:
            self._release(req)
            req.phase = Phase.WAITING
        return item

    # -- committing or undoing a step ---------------------------------------------------

    def commit(self, plan: StepPlan, sampled: dict[str, int]) -> None:
        """Apply a step that ran: advance ``kv_len``, append sampled tokens, finish.

        ``sampled`` maps request id to its new token, for items that sample.
        """
        for it in plan.items:
            req = it.req
            if req.phase is Phase.FINISHED:
                continue
            req.kv_len = it.start + it.num_tokens
            if req.ring:  # back to its size between steps (engine.kvcache.ring)
                self.ring.settle(req.ring, len(req.pages), req.kv_len)
            if req.phase is Phase.PREFILL:
                self._cache_prefix(req)
            if self.prefix_states is not None:
                self.prefix_states.keep(req, self._cache_prefix, decoding=req.phase is Phase.DECODE)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_ids.append(token)
            req.state.append(token)
            req.phase = Phase.DECODE
            if (broken := req.state.grammar_error()) is not None:  # fail closed, not a cut answer
                self.fail(req, ERROR_INVALID_SCHEMA, f"the JSON schema cannot be enforced: {broken}")
                continue
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
                self.finished_count += 1

    def rollback(self, plan: StepPlan) -> None:
        """Undo a planned step that failed: its new pages go back; admissions return to
        the waiting queue at their place. Preemptions made while planning stand (they
        were already consistent)."""
        for it in reversed(plan.items):
            req = it.req
            if it.new_pages:
                self.allocator.free(it.new_pages)
                del req.pages[len(req.pages) - len(it.new_pages) :]
            if req.ring:
                self.ring.settle(req.ring, len(req.pages), req.kv_len)
            if it.admitted:
                self._release(req)
                req.phase = Phase.WAITING
                self.running.remove(req)
                self.waiting.appendleft(req)

    # -- internals ----------------------------------------------------------------------

    def _stop_reason(self, req: Request, token: int) -> str | None:
        sp = req.sampling
        if (not sp.ignore_eos and token in self.config.eos_token_ids) or token in sp.stop_token_ids:
            return FINISH_STOP
        if len(req.output_ids) >= sp.max_new_tokens or req.total_len >= self.max_context_tokens:
            return FINISH_LENGTH
        return None

    def _alloc_for(self, req: Request, upto_len: int) -> list[int]:
        """Grow ``req.pages`` to hold ``upto_len`` tokens; returns the new pages.

        Raises:
            OutOfPages: not enough free pages even after evicting the prefix cache (or
                ring pages, :func:`engine.scheduler.ring_growth.grow_ring`).
        """
        need = math.ceil(upto_len / self.config.page_size) - len(req.pages)
        pages: list[int] = []
        if need > 0:
            short = need - self.allocator.num_free
            if short > 0 and self.radix is not None:
                self.radix.evict(short)
            pages = self.allocator.alloc(need)
            req.pages.extend(pages)
        if self.ring is not None:  # the ring follows the step's size, even without a new page
            grow_ring(self.ring, req, pages, self.allocator, self.running, self.radix, upto_len - req.kv_len)
        return pages

    def _evictable(self) -> int:
        return self.radix.evictable_pages() if self.radix is not None else 0

    def _cache_prefix(self, req: Request) -> None:
        """Hand the request's full, computed pages to the radix cache so that requests
        arriving later (or this one, after preemption) reuse them."""
        if self.radix is not None:
            cache_full_pages(self.radix, self.allocator, req, self.config.page_size)

    def _release(self, req: Request) -> None:
        """Give back the request's own pages and its pin on the prefix cache."""
        own = req.pages[req.cached_len // self.config.page_size :]
        if own:
            self.allocator.free(own)
        if self.radix is not None and req.last_node is not None:
            self.radix.unlock(req.last_node)
        if req.ring:
            if self.prefix_states is not None:
                self.prefix_states.forget(req)
            self.ring.give(req.ring)
            req.ring = []
        if req.state_slot is not None:
            # Its states describe the tokens of its pages: they go together.
            if self.prefix_states is not None:
                self.prefix_states.forget(req)
            self.states.free(req.state_slot)
            req.state_slot = None
        req.pages, req.last_node, req.kv_len, req.cached_len = [], None, 0, 0

    def _finish(self, req: Request, reason: str) -> None:
        if req.phase in (Phase.PREFILL, Phase.DECODE):
            self._cache_prefix(req)
            self._release(req)
            self.running.remove(req)
        elif req.phase is Phase.WAITING:
            self.waiting.remove(req)
        req.phase, req.finish_reason = Phase.FINISHED, reason
        self._ended.append(req)

    def _preempt(self, req: Request) -> None:
        self._cache_prefix(req)
        self._release(req)
        self.running.remove(req)
        req.phase = Phase.WAITING
        # Back at the head in arrival order: it was admitted before anything still waiting.
        self.waiting.appendleft(req)

    def preempt(self, req: Request) -> None:
        """Send a request back to the waiting queue to be recomputed later, in arrival
        order (so the youngest preempted is the last readmitted). Its computed full pages
        stay in the prefix cache; a waiting request is only moved to its place.

        Raises:
            ValueError: ``req`` is finished or not known to this scheduler.
        """
        if req.phase is Phase.FINISHED or self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id!r} is not running or waiting here")
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
        else:
            self._cache_prefix(req)
            self._release(req)
            self.running.remove(req)
            req.phase = Phase.WAITING
        at = next((i for i, w in enumerate(self.waiting) if w.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(at, req)

    def _youngest_running(self, exclude_planned: StepPlan) -> Request | None:
        planned = {id(it.req) for it in exclude_planned.items}
        for req in reversed(self.running):
            if id(req) not in planned:
                return req
        return None
