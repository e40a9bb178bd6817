"""When to give GPU memory back, and when to take it again: a pure controller.

Fed a :class:`service.vram.sources.VramSample` and the engine's :class:`PoolState` a few times a
second, :meth:`ReplanController.decide` returns what the worker should do (the watcher carries it out; see
``docs/memory-plan.md``, "The watcher and the controller"). ``headroom = free - reserve``.

Below the low water mark, memory is given back cheapest first, until the headroom is
expected back at the middle of the band:

1. lower the prefill chunk cap (the step's transient activation memory; nothing that
   runs is lost, long prompts take more steps), not below ``min_prefill_chunk``;
2. shrink the GPU expert cache, when routed experts live in host memory
   (``--cpu-experts``), by whole slots, down to none: every expert stays in host memory,
   so nothing that runs is lost; a miss runs on the CPU or is copied in for the step;
3. evict unreferenced prefix-cache pages (only lost work that may be recomputed), when
   the shrink that follows needs more pages than are free (an eviction by itself gives
   the device nothing: the pages stay in the pool until it shrinks);
4. shrink the KV pool by whole pages (live: running requests keep going; the youngest
   are preempted and recomputed if pages run short), never below ``min_pages`` (one
   request of the minimum context);
5. move a dense model's split (``--cpu-layers auto``): the fewest of the device's last
   decoder layers that free the rest go to the CPU (:mod:`service.vram.split_rung`).
   When even that is not enough, a :class:`Squeeze` is reported once per episode (the
   service logs it and shows who holds the memory) instead of shrinking further.

Above the high water mark for ``hold_s`` seconds in a row, memory is taken back in the
reverse order: the layers moved to the CPU come back (the pool grows only once they
all have), the pool grows back toward the plan, then the expert cache, then the
chunk cap, never so far that the headroom drops below ``low + (high - low) / 4``; each
grow restarts the hold.

Why this does not flap: a shrink leaves the headroom at the band's middle, a grow never
below its lower quarter, so after either the headroom sits inside ``(low, high)``, and
only a move of a quarter of the band or more (not a browser's wobble) starts the next
decision; growing also waits ``hold_s``, so a spike that comes and goes costs one
shrink, not a shrink and a grow each time. After a pool resize, shrinks wait
``settle_s`` for the samples to show it (unless the headroom is negative: memory is
needed now).

When NVML shows (almost) nothing free, another process wants more than the card has
and takes whatever is given back; how much it wants is unknown. Shrinks made while the
card stays pinned like that double in size, sample after sample (slow start, as TCP
probes an unknown capacity): a 6 GiB demand is met in three or four decisions, not
twenty, and the overshoot is at most the last step, which the reserve mostly absorbs
and the hold-gated grow returns.

Torch-free and clock-free: time is the samples' ``timestamp``, so tests drive it with a
scripted timeline (``service.vram.simulated.SimulatedSource``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from engine.memory.kv_fit import RingRule, pages_freeing, pages_within, pool_cost, usable_pages
from engine.memory.plan import MIN_PREFILL_TOKENS, MiB, fmt_bytes, safety_margin_for
from service.vram.sources import VramSample, resolve_reserve
from service.vram.split_rung import NewSplit, give_back, take_back

if TYPE_CHECKING:
    from engine.wire.ipc import PoolStats

DEFAULT_HOLD_S = 10.0
DEFAULT_SETTLE_S = 0.5


def default_water_marks(total_bytes: int) -> tuple[int, int]:
    """``(low, high)`` water marks of headroom, in bytes, for a card of ``total_bytes``.

    The plan leaves its safety margin (``128 MiB + 1%`` of the card,
    :func:`engine.memory.plan.safety_margin_for`) free above the reserve, so right after
    start the headroom is about that margin. Low water is a quarter of it: another
    process has taken three quarters of what the plan kept spare. High water is
    ``256 MiB + 2%`` of the card above that: growing needs a real surplus, so the
    swings of a browser or a compositor (tens to a few hundred MiB) never move the pool;
    and a grow, which stops at a quarter of the band above low water, can still bring
    the pool all the way back to the plan (that quarter is below the margin).
    """
    low = safety_margin_for(total_bytes) // 4
    high = low + 256 * MiB + int(0.02 * total_bytes)
    return low, high


@dataclass(frozen=True)
class PoolState:
    """The engine's memory as the controller needs it (from the worker's stats).

    ``pages`` is the KV pool now, ``planned_pages`` what the memory plan gave it (the
    ceiling to grow back to), ``min_pages`` the pool that holds one request of the
    minimum context (the floor; ``Engine.min_kv_pool_pages()``), all counting the null
    page as ``Engine.resize_kv_pool`` does. ``page_bytes`` is one page's device memory;
    ``ring``, for a model whose sliding-window layers keep a ring, sets the ring pool
    beside each size, whose bytes a resize frees or takes too (:meth:`bytes_at`).
    ``free_pages`` are held by nobody, ``cached_pages`` only by the prefix cache.
    ``prefill_chunk`` is the chunk cap now, ``planned_prefill_chunk`` the plan's.
    ``activation_bytes_per_token`` prices the chunk cap (the plan's activation peak per
    token of chunk); 0 when unknown, then lowering it is still tried first but counted
    as freeing nothing.
    ``expert_slots`` is the GPU expert cache now (slots over every layer whose routed
    experts live in host memory), ``planned_expert_slots`` the plan's (the ceiling to
    grow back to), ``expert_slot_bytes`` one slot's device memory; all 0 when every
    expert is on the device (then the step is skipped). The split's fields are
    ``engine.wire.ipc.PoolStats``' (all 0 where it cannot move).
    """

    pages: int
    planned_pages: int
    min_pages: int
    page_bytes: int
    prefill_chunk: int
    planned_prefill_chunk: int
    min_prefill_chunk: int = MIN_PREFILL_TOKENS
    activation_bytes_per_token: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    expert_slots: int = 0
    planned_expert_slots: int = 0
    expert_slot_bytes: int = 0
    cpu_layers: int = 0
    planned_cpu_layers: int = 0
    max_cpu_layers: int = 0
    layer_bytes: int = 0
    device_layers: int = 0
    ring: RingRule | None = None

    def bytes_at(self, pages: int) -> int:
        """The device bytes of a KV pool of ``pages`` pages (null page included) and the
        ring pool beside it (:func:`engine.memory.kv_fit.pool_cost`)."""
        return pool_cost(pages, self.page_bytes, self.ring)

    @classmethod
    def from_stats(cls, stats: PoolStats, *, planned_pages: int, planned_expert_slots: int) -> PoolState:
        """The worker's ``stats`` (each field of this class is one of theirs, same name and
        unit) with the ceilings to grow back to in place of the plan's."""
        ceilings = {"planned_pages": planned_pages, "planned_expert_slots": planned_expert_slots}
        read = {f.name: getattr(stats, f.name) for f in fields(cls) if f.name not in ceilings}
        return cls(**read, **ceilings)


@dataclass(frozen=True)
class NewChunkCap:
    """Set the engine-wide prefill chunk cap (``Engine.set_prefill_chunk``)."""

    tokens: int
    before: int
    reason: str


@dataclass(frozen=True)
class EmptyPrefixCache:
    """Free the prefix cache's unreferenced pages (``Engine.evict_prefix_cache``)."""

    reason: str


@dataclass(frozen=True)
class NewExpertCache:
    """Resize the GPU expert cache to ``num_slots`` slots over all its layers
    (``Engine.resize_expert_cache``)."""

    num_slots: int
    before: int
    reason: str

    @property
    def grows(self) -> bool:
        return self.num_slots > self.before


@dataclass(frozen=True)
class NewPoolSize:
    """Resize the KV pool to ``num_pages`` pages, null page included
    (``Engine.resize_kv_pool``)."""

    num_pages: int
    before: int
    reason: str

    @property
    def grows(self) -> bool:
        return self.num_pages > self.before


@dataclass(frozen=True)
class Squeeze:
    """Nothing more can be given back, and the headroom is still expected below low
    water by ``shortfall_bytes``: a report for the log and the health page, not an
    action for the worker."""

    shortfall_bytes: int
    message: str


Action = NewChunkCap | NewExpertCache | EmptyPrefixCache | NewPoolSize | NewSplit | Squeeze


@dataclass(frozen=True)
class Decision:
    """What :meth:`ReplanController.decide` returned at ``timestamp``, and the headroom
    it saw."""

    timestamp: float
    headroom_bytes: int
    actions: tuple[Action, ...]


@dataclass
class ReplanController:
    """Decides, sample by sample, what memory the engine gives back or takes again.

    Args:
        low_water_bytes, high_water_bytes: the band of headroom in which nothing is done
            (:func:`default_water_marks` gives defaults for a card).
        hold_s: seconds the headroom must stay above high water before a grow.
        reserve: ``--reserve``: bytes, or None for auto (from each sample: whether a
            display is attached; :func:`service.vram.sources.resolve_reserve`).
        settle_s: after a resize (of the pool or the expert cache), further shrinks wait
            this long for the samples to show it (not when the headroom is negative).

    Call :meth:`decide` once per sample with the pool as it is after the last decision
    was applied. ``decisions`` keeps every non-empty decision, in order.

    Raises (constructor):
        ValueError: water marks not ``0 <= low < high``, or a negative hold.
    """

    low_water_bytes: int
    high_water_bytes: int
    hold_s: float = DEFAULT_HOLD_S
    reserve: int | None = None
    settle_s: float = DEFAULT_SETTLE_S
    decisions: list[Decision] = field(default_factory=list, repr=False)
    # State between samples: since when the headroom has stayed above high water; when
    # the pool was last resized; the last give-back's size and when the card was last
    # seen pinned (for doubling); whether this squeeze episode was reported.
    _above_since: float | None = field(default=None, init=False, repr=False)
    _last_resize_at: float = field(default=-math.inf, init=False, repr=False)
    _last_need: int = field(default=0, init=False, repr=False)
    _pinned_at: float = field(default=-math.inf, init=False, repr=False)
    _squeezed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.low_water_bytes < self.high_water_bytes:
            raise ValueError(
                f"the water marks must satisfy 0 <= low < high, got low {self.low_water_bytes} "
                f"and high {self.high_water_bytes} bytes"
            )
        if self.hold_s < 0 or self.settle_s < 0:
            raise ValueError("hold_s and settle_s must be >= 0 seconds")

    # -- counters -------------------------------------------------------------------------

    def _count(self, kind: type, grows: bool | None = None) -> int:
        return sum(
            1
            for d in self.decisions
            for a in d.actions
            if isinstance(a, kind) and (grows is None or a.grows == grows)
        )

    @property
    def shrinks(self) -> int:
        """Pool shrinks decided so far."""
        return self._count(NewPoolSize, grows=False)

    @property
    def grows(self) -> int:
        """Pool grows decided so far."""
        return self._count(NewPoolSize, grows=True)

    @property
    def expert_shrinks(self) -> int:
        """Expert cache shrinks decided so far."""
        return self._count(NewExpertCache, grows=False)

    @property
    def expert_grows(self) -> int:
        """Expert cache grows decided so far."""
        return self._count(NewExpertCache, grows=True)

    @property
    def squeezes(self) -> int:
        return self._count(Squeeze)

    @property
    def grow_floor_bytes(self) -> int:
        """A grow never leaves less headroom than this: a quarter of the band above low."""
        return self.low_water_bytes + (self.high_water_bytes - self.low_water_bytes) // 4

    @property
    def shrink_target_bytes(self) -> int:
        """A shrink aims to leave this much headroom: the band's middle."""
        return (self.low_water_bytes + self.high_water_bytes) // 2

    # -- deciding -------------------------------------------------------------------------

    def decide(self, sample: VramSample, pool: PoolState) -> list[Action]:
        """What to do now. Empty most of the time; in CPU mode always."""
        if not sample.gpu:
            return []
        reserve = resolve_reserve(self.reserve, sample)
        headroom = sample.headroom(reserve)
        now = sample.timestamp
        if headroom < self.low_water_bytes:
            self._above_since = None
            actions = self._give_back(now, headroom, reserve, sample, pool)
        elif headroom > self.high_water_bytes:
            self._squeezed = False
            actions = self._take_back(now, headroom, pool)
        else:
            self._above_since = None
            self._squeezed = False
            actions = []
        if actions:
            self.decisions.append(Decision(now, headroom, tuple(actions)))
        return actions

    def _give_back(
        self, now: float, headroom: int, reserve: int, sample: VramSample, pool: PoolState
    ) -> list[Action]:
        pinned = sample.free_bytes <= pool.page_bytes
        if now - self._last_resize_at < self.settle_s and headroom >= 0 and not pinned:
            return []  # the last resize may not show in the samples yet
        need = self.shrink_target_bytes - headroom
        if pinned and now - self._pinned_at <= self.settle_s:
            # Still pinned right after a pinned give-back: it was taken at once, and more
            # is wanted. Give twice as much as last time.
            need = max(need, 2 * self._last_need)
        self._last_need = need
        if pinned:
            self._pinned_at = now
        others = ", ".join(
            f"{p.name} (pid {p.pid}) {fmt_bytes(p.bytes)}" for p in sample.top_consumers[:3]
        )
        reason = (
            f"headroom {fmt_bytes(headroom)} is below the low water mark of "
            f"{fmt_bytes(self.low_water_bytes)} (free {fmt_bytes(sample.free_bytes)} - reserve "
            f"{fmt_bytes(reserve)}; other processes hold {fmt_bytes(sample.others_bytes)}"
            + (f": {others}" if others else "")
            + ")"
        )
        actions: list[Action] = []
        freed = 0
        apt = pool.activation_bytes_per_token
        floor_chunk = min(pool.min_prefill_chunk, pool.planned_prefill_chunk)
        chunk = pool.prefill_chunk
        if pool.prefill_chunk > floor_chunk:
            if apt > 0:
                chunk = max(floor_chunk, pool.prefill_chunk - math.ceil(need / apt))
            else:
                chunk = max(floor_chunk, pool.prefill_chunk // 2)
            actions.append(NewChunkCap(chunk, pool.prefill_chunk, reason))
            freed += (pool.prefill_chunk - chunk) * apt
        if need > freed and pool.expert_slots > 0 and pool.expert_slot_bytes > 0:
            give = min(math.ceil((need - freed) / pool.expert_slot_bytes), pool.expert_slots)
            actions.append(NewExpertCache(pool.expert_slots - give, pool.expert_slots, reason))
            self._last_resize_at = now
            freed += give * pool.expert_slot_bytes
        pages = pool.pages
        if need > freed:
            floor_pages = min(max(pool.min_pages, 2), pool.pages)
            pages = pages_freeing(pool.pages, pool.page_bytes, pool.ring, need - freed, floor_pages)
            give = pool.pages - pages
            if give > 0:
                if pool.cached_pages > 0 and give > pool.free_pages:
                    actions.append(EmptyPrefixCache(reason))
                actions.append(NewPoolSize(pages, pool.pages, reason))
                self._last_resize_at = now
                freed += pool.bytes_at(pool.pages) - pool.bytes_at(pages)
        move, moved = give_back(pool, min(need, self.shrink_target_bytes - headroom) - freed, pages, reason)
        if move is not None:
            actions.append(move)
            self._last_resize_at = now
            freed += moved
        # A squeeze is judged on the headroom now plus what was freed, not on a doubled
        # probe (which is a guess at an unknown demand, not a shortfall).
        expected = headroom + freed
        if expected < self.low_water_bytes and not self._squeezed:
            self._squeezed = True
            short = self.low_water_bytes - expected
            actions.append(
                Squeeze(
                    short,
                    f"GPU memory squeeze: {reason}; the KV pool is at its floor of "
                    f"{usable_pages(max(pool.min_pages, 2))} pages (one request of the minimum context), "
                    + ("the expert cache empty (every routed expert in host memory), "
                       if pool.planned_expert_slots > 0 else "")
                    + (f"{pool.max_cpu_layers} decoder layers on the CPU, " if pool.max_cpu_layers else "")
                    + f"and the prefill chunk at {chunk} tokens, so the headroom stays about {fmt_bytes(short)} below low water. "
                    "Requests may fail with out_of_memory until the other processes let go.",
                )
            )
        return actions

    def _take_back(self, now: float, headroom: int, pool: PoolState) -> list[Action]:
        if (pool.pages >= pool.planned_pages and pool.cpu_layers <= pool.planned_cpu_layers
                and pool.expert_slots >= pool.planned_expert_slots and pool.prefill_chunk >= pool.planned_prefill_chunk):
            self._above_since = None
            return []  # the plan is whole: nothing to take back
        if self._above_since is None:
            self._above_since = now
        if now - self._above_since < self.hold_s:
            return []
        spare = headroom - self.grow_floor_bytes
        reason = (
            f"headroom {fmt_bytes(headroom)} stayed above the high water mark of "
            f"{fmt_bytes(self.high_water_bytes)} for {now - self._above_since:.1f} s"
        )
        if pool.cpu_layers > pool.planned_cpu_layers:  # the split's layers come back first
            move, _ = take_back(pool, spare, reason)
            if move is None:
                return []
            self._above_since = self._last_resize_at = now  # the next grow waits another hold
            return [move]
        actions: list[Action] = []
        pages = pool.pages
        if pages < pool.planned_pages:
            grown = pages_within(pages, pool.page_bytes, pool.ring, spare, pool.planned_pages)
            if grown > pages:
                actions.append(NewPoolSize(grown, pages, reason))
                self._last_resize_at = now
                spare -= pool.bytes_at(grown) - pool.bytes_at(pages)
                pages = grown
        slots = pool.expert_slots
        if pages >= pool.planned_pages and slots < pool.planned_expert_slots and pool.expert_slot_bytes > 0:
            grow = min(max(spare, 0) // pool.expert_slot_bytes, pool.planned_expert_slots - slots)
            if grow > 0:
                actions.append(NewExpertCache(slots + grow, slots, reason))
                self._last_resize_at = now
                slots += grow
                spare -= grow * pool.expert_slot_bytes
        if (
            pages >= pool.planned_pages
            and slots >= pool.planned_expert_slots
            and pool.prefill_chunk < pool.planned_prefill_chunk
        ):
            apt = pool.activation_bytes_per_token
            chunk = (
                pool.planned_prefill_chunk
                if apt <= 0
                else min(pool.planned_prefill_chunk, pool.prefill_chunk + max(spare, 0) // apt)
            )
            if chunk > pool.prefill_chunk:
                actions.append(NewChunkCap(chunk, pool.prefill_chunk, reason))
        if actions:
            self._above_since = now  # the next grow waits for another quiet hold
        return actions
