"""Live replans: the engine changes its memory use while requests run.

The service's VRAM watcher asks for these, cheapest first, when another process takes
device memory: a smaller prefill chunk cap, an empty prefix cache, a smaller GPU expert
cache (:meth:`LiveReplan.resize_expert_cache`, for experts in host memory), a smaller
KV pool; and for them to grow back when the memory returns. A person may ask too, through
the control API: ``origin`` says who asked. Each change that happens queues a
``Replanned`` event (with that origin) for ``Engine.drain_events``. Call them between
steps (the engine is single-threaded).

:class:`LiveReplan` is a part of :class:`engine.core.engine.Engine` (it uses the engine's
``pool``, ``runner``, ``scheduler``, ``radix``, ``plan``, ``knobs``, ``info``,
``config`` and ``device``); the page work of a shrink is the scheduler's
(:func:`engine.scheduler.resize.shrink_pages`). A resize gives the pool new
buffers, so the runner's decode CUDA graphs, which hold the old addresses, are dropped
first (:meth:`engine.core.runner.ModelRunner.pool_will_move`) and captured again on next use.
A model whose sliding-window layers keep a ring has the ring pool resized with the KV
pool, by the rule the plan sized it with at start (``Engine.ring_rule``,
:class:`engine.memory.kv_fit.RingRule`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

import msgspec
import torch

from engine.common.units import fmt_bytes
from engine.layers.moe.offload import resize_cache
from engine.memory.kv_fit import usable_pages
from engine.scheduler.resize import Vacated, grow_pages, shrink_pages, shrink_rings
from engine.wire.messages import (
    BY_WATCHER,
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_EXPERT_CACHE,
    REPLAN_RESIZE_POOL,
    Replanned,
    ReplanOrigin,
    ResizeResult,
)

log = logging.getLogger("headroom.engine")


class LiveReplan:
    """The engine's live replan methods (see the module docstring)."""

    # Replanned events not yet drained; the list is made on the first change (an engine
    # that never replans carries none).
    _replans: list[Replanned] | None = None

    @property
    def kv_page_bytes(self) -> int:
        """Device bytes one KV page costs over all layers (but a sliding-window ring's,
        whose pool follows the pages by ``ring_rule``), keys and values."""
        return self.pool.page_bytes

    def min_kv_pool_pages(self, context_tokens: int | None = None) -> int:
        """The smallest pool (pages, null page included) that holds one request of
        ``context_tokens`` (default: the plan's minimum context; without a plan
        ``--min-context`` capped by the model's, the floor ``--kv-cache`` takes at start)."""
        if context_tokens is None:
            model = self.info.model_context_tokens
            context_tokens = (self.plan.min_context_tokens if self.plan is not None
                              else min(self.config.min_context or model, model))
        return math.ceil(context_tokens / self.config.page_size) + 1

    @property
    def expert_cache_slots(self) -> int:
        """Slots of the GPU expert cache now, over every layer whose routed experts live
        in host memory (0 without such layers)."""
        return sum(s.num_slots for s in getattr(self, "expert_stores", []))

    @property
    def expert_cache_bytes(self) -> int:
        """Device bytes of the GPU expert cache now."""
        return sum(s.num_slots * s.slot_bytes for s in getattr(self, "expert_stores", []))

    @property
    def max_expert_cache_slots(self) -> int:
        """The most slots the expert cache can use: every offloaded expert cached."""
        return sum(s.num_experts for s in getattr(self, "expert_stores", []))

    def resize_expert_cache(
        self, num_slots: int, *, reason: str = "", origin: ReplanOrigin = BY_WATCHER
    ) -> int:
        """Resize the GPU expert cache of the layers whose routed experts live in host
        memory to ``num_slots`` slots in all (spread over the layers; capped by their
        experts), between steps: the cheapest memory to give back, as every expert stays
        in host memory and no request can fail for it (misses are copied in again or run
        on the CPU). Returns the device bytes freed (negative when it grew); a
        ``Replanned`` event (``REPLAN_RESIZE_EXPERT_CACHE``) is queued when the size
        changed.

        Raises:
            ValueError: ``num_slots`` < 0, or this engine has no experts in host memory.
            torch.OutOfMemoryError: a grow did not fit; the layers resized before it
                keep their new size, the rest their old (all consistent).
        """
        stores = getattr(self, "expert_stores", [])
        if not stores:
            raise ValueError("no routed experts live in host memory (--cpu-experts): there is no expert cache")
        if num_slots < 0:
            raise ValueError(f"num_slots {num_slots} must be >= 0")
        started = time.perf_counter()
        before_slots, before = self.expert_cache_slots, self.expert_cache_bytes
        self.runner.pool_will_move()  # the decode graphs read the caches' buffers
        try:
            resize_cache(stores, num_slots)
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            after_slots, after = self.expert_cache_slots, self.expert_cache_bytes
            if after_slots != before_slots:
                ms = (time.perf_counter() - started) * 1000
                log.info("expert cache %d -> %d slots (%.1f -> %.1f MiB) in %.1f ms%s", before_slots, after_slots,
                         before / 2**20, after / 2**20, ms, f" ({reason})" if reason else "")
                self._replanned(
                    REPLAN_RESIZE_EXPERT_CACHE, reason, origin, self.pool.num_pages, self.pool.nbytes, ms,
                    before_expert_slots=before_slots, before_expert_bytes=before,
                )
        return before - after

    def resize_kv_pool(self, num_pages: int, *, reason: str = "", origin: ReplanOrigin = BY_WATCHER) -> ResizeResult:
        """Shrink or grow the KV pool to ``num_pages`` pages (null page included) while
        requests run, and give the memory back to the device.

        Shrinking keeps every running request whose context still fits. The scheduler
        frees the pages at or above the cut (:func:`engine.scheduler.resize.shrink_pages`, described
        step by step in :mod:`engine.scheduler.resize`):

        1. Requests that no longer fit in the new per-request context
           (``min(model context, (num_pages - 1) * page_size)`` tokens), running or
           waiting, end: ``finish_reason="length"`` when they have produced output, else
           ``error_code="out_of_memory"`` (the service answers 503 with Retry-After).
        2. Unreferenced prefix-cache pages at or above the cut are evicted.
        3. Live pages at or above the cut get free ids below it (evicting least recently
           used cache pages, then preempting the youngest running requests when there is
           no room); the engine copies their keys and values (:meth:`KVPool.copy_pages`).
        4. The allocator and the pool shrink, layer by layer (:meth:`KVPool.resize`).

        Growing adds free pages at the top and raises the context limit back.

        A sliding-window ring pool follows, to ``ring_rule``'s pages beside the new pool:
        a shrink frees its pages above the cut as step 3 does (ring pages moved, prefix-cache
        checkpoints dropped, the youngest requests preempted where too few are free:
        :func:`engine.scheduler.resize.shrink_rings`); a grow adds free ring pages.

        Returns:
            What was done; a :class:`engine.wire.messages.Replanned` event with the same
            figures is queued for :meth:`drain_events`.

        Raises:
            ValueError: ``num_pages < 2``.
            torch.OutOfMemoryError: a new buffer did not fit (growing, or shrinking on
                a full device); the pool then stays consistent at the smaller size
                (see :meth:`KVPool.resize`) and the engine keeps running.
        """
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        started = time.perf_counter()
        before_pages, before_bytes, before_rings = self.pool.num_pages, self.pool.nbytes, self.pool.ring_pages
        before_kv_pool = self.pool.usable_bytes
        shrunk = Vacated()
        if num_pages < before_pages:
            shrunk = shrink_pages(self.scheduler, num_pages, self._context_limit(num_pages))
            rings = self._vacate_rings(num_pages)
            shrunk = replace(shrunk, preempted=shrunk.preempted + rings.preempted, ring_moves=rings.ring_moves)
            self.pool.copy_pages(list(shrunk.moves), list(shrunk.moves.values()))
            host = self.model.host_layers if hasattr(self.model, "host_layers") else None
            if host is not None:  # --cpu-layers: the same pages of the host pool move too
                host.copy_pages(list(shrunk.moves), list(shrunk.moves.values()))
            self.runner.pool_will_move()
            try:
                self._resize_buffers(num_pages)
                self._rings_follow()
            finally:
                self._pool_resized()
        elif num_pages > before_pages:
            self.runner.pool_will_move()
            try:
                self._resize_buffers(num_pages)
                self._rings_follow()
            finally:
                # After a failed grow the pool is consistent at its old size.
                grow_pages(self.scheduler, self.pool.num_pages, self._context_limit(self.pool.num_pages))
                self._pool_resized()
        evicted, relocated, preempted, ended = (
            shrunk.evicted_pages, len(shrunk.moves) + len(shrunk.ring_moves), shrunk.preempted, shrunk.ended
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result = ResizeResult(
            before_pages=before_pages,
            after_pages=self.pool.num_pages,
            before_bytes=before_bytes,
            after_bytes=self.pool.nbytes,
            before_kv_pool_bytes=before_kv_pool,
            after_kv_pool_bytes=self.pool.usable_bytes,
            before_ring_pages=before_rings,
            after_ring_pages=self.pool.ring_pages,
            evicted_pages=evicted,
            relocated_pages=relocated,
            preempted=preempted,
            ended=ended,
            max_context_tokens=self.max_context_tokens,
            duration_ms=(time.perf_counter() - started) * 1000,
        )
        if result.after_pages != before_pages:
            # Pages as people read them everywhere: usable ones (kv_fit.usable_pages).
            log.info(
                "KV pool %s: %d -> %d pages%s (%.1f -> %.1f MiB) in %.1f ms; %d evicted, %d moved, "
                "%d preempted, %d ended; context limit %d tokens%s",
                "shrunk" if result.after_pages < before_pages else "grown", usable_pages(before_pages),
                usable_pages(result.after_pages),
                f", sliding-window rings {usable_pages(before_rings)} -> {usable_pages(result.after_ring_pages)}"
                if before_rings else "", before_bytes / 2**20, result.after_bytes / 2**20,
                result.duration_ms, evicted, relocated, len(preempted), len(ended),
                self.max_context_tokens, f" ({reason})" if reason else "",
            )
            self._replanned(
                REPLAN_RESIZE_POOL, reason, origin, before_pages, before_bytes, result.duration_ms,
                evicted_pages=evicted, relocated_pages=relocated, preempted=preempted, ended=ended,
                before_ring_pages=before_rings, before_kv_pool_bytes=before_kv_pool,
            )
        return result

    def set_prefill_chunk(
        self, max_prefill_tokens: int, *, reason: str = "", origin: ReplanOrigin = BY_WATCHER
    ) -> int:
        """Set the engine-wide prefill chunk cap (new tokens per step), at most what the
        memory plan fitted (``knobs.max_prefill_tokens``: a larger chunk's activation
        peak was never budgeted). A smaller cap lowers the step's transient memory (on
        CUDA the allocator's cache is emptied, so the device sees it at once); a cap
        below the number of running requests leaves no room for prefill next to their
        decodes, so the service keeps it at 256 or more (``MIN_PREFILL_TOKENS``).

        Returns:
            The cap now in force. A ``Replanned`` event is queued when it changed.

        Raises:
            ValueError: ``max_prefill_tokens < 1``.
        """
        if max_prefill_tokens < 1:
            raise ValueError(f"the prefill chunk cap must be >= 1 token, got {max_prefill_tokens}")
        before = self.scheduler.max_prefill_tokens
        after = min(max_prefill_tokens, self.knobs.max_prefill_tokens)
        self.scheduler.max_prefill_tokens = after
        if after < before and self.device.type == "cuda":
            # The larger steps' activation blocks sit in the allocator's cache: give them
            # back, or the device sees no change.
            torch.cuda.empty_cache()
        if after != before:
            log.info("prefill chunk cap %d -> %d tokens%s", before, after, f" ({reason})" if reason else "")
            self._replanned(REPLAN_PREFILL_CHUNK, reason, origin, self.pool.num_pages, self.pool.nbytes, 0.0)
        return after

    def evict_prefix_cache(self, *, reason: str = "", origin: ReplanOrigin = BY_WATCHER) -> int:
        """Free every prefix-cache page no running request uses.

        Returns:
            Pages freed. A ``Replanned`` event is queued when some were.
        """
        if self.radix is None:
            return 0
        started = time.perf_counter()
        freed = self.radix.clear()
        # A CPU pool's pages stay resident once written: the free ones go back to the OS
        # here (on CUDA the pool gives memory back by resizing).
        given = self.pool.release_memory(self.allocator.free_ids()) if freed else 0
        if freed:
            # What the evicted pages held (the pool's free pages are all given back, most
            # of which were never written and held no memory: their bytes say nothing).
            held = freed * self.pool.page_bytes
            log.info("prefix cache: %d pages evicted, %s of keys and values%s%s", freed, fmt_bytes(held),
                     ", their host memory given back" if given else "", f" ({reason})" if reason else "")
            self._replanned(
                REPLAN_EVICT_PREFIX_CACHE, reason, origin, self.pool.num_pages, self.pool.nbytes,
                (time.perf_counter() - started) * 1000, evicted_pages=freed,
            )
        return freed

    def _replanned(
        self, action: str, reason: str, origin: ReplanOrigin, before_pages: int, before_bytes: int,
        duration_ms: float, **extra,
    ) -> None:
        if self._replans is None:
            self._replans = []
        self._replans.append(Replanned(
            action=action, reason=reason, origin=origin, before_pages=before_pages, after_pages=self.pool.num_pages,
            before_bytes=before_bytes, after_bytes=self.pool.nbytes, after_kv_pool_bytes=self.pool.usable_bytes,
            duration_ms=duration_ms,
            max_prefill_tokens=self.scheduler.max_prefill_tokens,
            max_context_tokens=self.max_context_tokens,
            **{"before_expert_slots": self.expert_cache_slots, "before_expert_bytes": self.expert_cache_bytes,
               "before_cpu_layers": self.cpu_layers, "before_ring_pages": self.pool.ring_pages,
               "before_kv_pool_bytes": self.pool.usable_bytes, **extra},
            after_expert_slots=self.expert_cache_slots, after_expert_bytes=self.expert_cache_bytes,
            after_cpu_layers=self.cpu_layers, after_ring_pages=self.pool.ring_pages,
        ))

    def _vacate_rings(self, num_pages: int) -> Vacated:
        """Free the ring pages beyond ``ring_rule``'s ring pool beside a KV pool of
        ``num_pages`` pages (null pages included), before the buffers shrink: the
        scheduler's :func:`engine.scheduler.resize.shrink_rings`, then the moved pages'
        keys and values copied in the ring layers. Nothing without a ring or a shrink."""
        rule = self.ring_rule
        target = rule.rings(num_pages - 1) + 1 if rule is not None else 0
        if not target or target >= self.ring.allocator.num_pages:
            return Vacated()
        vacated = shrink_rings(self.scheduler, target)
        self.pool.copy_pages(list(vacated.ring_moves), list(vacated.ring_moves.values()), ring=True)
        return vacated

    def _rings_follow(self) -> None:
        """After the KV pool resized: the ring layers' buffers shrink to the pages
        :meth:`_vacate_rings` left the ring allocator, or, where ``ring_rule`` gives more
        beside the pool now, grow and the allocator with them (to the buffers' size after
        a grow that ran out of memory)."""
        rule = self.ring_rule
        if rule is None:
            return
        have = self.ring.allocator.num_pages
        written = self.ring.allocator.high_water
        if self.pool.ring_pages > have:
            self.pool.resize_ring(have, written_pages=written)
            return
        target = rule.rings(self.pool.num_pages - 1) + 1
        if target > have:
            try:
                self.pool.resize_ring(target, written_pages=written)
            finally:
                self.ring.allocator.resize(self.pool.ring_pages)

    def _resize_buffers(self, num_pages: int) -> None:
        """Resize the pool's buffers (:meth:`engine.kvcache.pool.KVPool.resize`), copying
        only the pages the allocator ever handed out (on the CPU the rest stay
        unresident), slowed by the test-only ``slow_resize`` fault where one is armed."""
        faults = self.runner.faults
        seconds = faults.resize_seconds() if faults is not None else 0.0
        buffers = 2 * (self.pool.num_layers - len(self.pool.ring_layers))
        pause = (lambda: time.sleep(seconds / buffers)) if seconds > 0 else None
        self.pool.resize(num_pages, written_pages=self.allocator.high_water, after_buffer=pause)

    def _context_limit(self, num_pages: int) -> int:
        """The per-request context limit for a pool of ``num_pages`` (null page included)."""
        return min(self.info.model_context_tokens, (num_pages - 1) * self.config.page_size)

    def _pool_resized(self) -> None:
        host = getattr(self.model, "host_layers", None)
        if host is not None:  # --cpu-layers: the host pool's pages follow at once, not at the next step
            host.follow(self.pool.num_pages, written_pages=self.allocator.high_water)
        self.info = msgspec.structs.replace(
            self.info, num_pages=usable_pages(self.pool.num_pages), kv_cache_bytes=self.pool.usable_bytes,
            kv_buffer_bytes=self.pool.nbytes,
            max_context_tokens=self.max_context_tokens,
        )
