"""The GPU expert cache in the replan, torch-free: with routed experts in host memory,
the expert cache gives memory back after the chunk cap and before the KV pool, and takes
it again after the pool has regained the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from replan_timeline import (
    CHUNK,
    DESKTOP,
    MIN_PAGES,
    PAGE,
    PLANNED,
    TOTAL,
    EngineModel,
    desktop_day,
    run_timeline,
)

from engine.memory.plan import MiB
from service.vram.replan import (
    EmptyPrefixCache,
    NewChunkCap,
    NewExpertCache,
    NewPoolSize,
    PoolState,
    Squeeze,
    default_water_marks,
)

# -- the GPU expert cache: after the chunk cap, before the KV pool -----------------------

SLOT = 24 * MiB  # one routed expert of one layer (a large MoE's, in bf16)
SLOTS = 64  # the plan's expert cache: 1.5 GiB
HYBRID_PAGES = PLANNED - SLOTS * SLOT // PAGE  # the same card: the cache came out of the pool


@dataclass
class HybridEngineModel(EngineModel):
    """:class:`EngineModel` with routed experts in host memory behind a GPU expert cache
    of ``slots`` slots (the plan's: ``SLOTS``)."""

    pages: int = HYBRID_PAGES
    slots: int = SLOTS

    def ours(self) -> int:
        return super().ours() + self.slots * SLOT

    def state(self) -> PoolState:
        return dataclasses.replace(
            super().state(), planned_pages=HYBRID_PAGES, expert_slots=self.slots, planned_expert_slots=SLOTS,
            expert_slot_bytes=SLOT,
        )

    def apply(self, actions) -> None:
        super().apply(actions)
        for a in actions:
            if isinstance(a, NewExpertCache):
                assert a.before == self.slots
                self.slots = a.num_slots


def replan_steps(ctl) -> list[str]:
    """Every action decided, in order, as ``"<what><+|->"`` (``chunk``, ``experts``,
    ``pool``; the prefix cache's eviction as ``evict``), repeats of the same step merged."""
    names = {NewChunkCap: "chunk", NewExpertCache: "experts", NewPoolSize: "pool"}
    out: list[str] = []
    for d in ctl.decisions:
        for a in d.actions:
            if isinstance(a, EmptyPrefixCache):
                step = "evict"
            elif type(a) in names:
                grows = a.tokens > a.before if isinstance(a, NewChunkCap) else a.grows
                step = names[type(a)] + ("+" if grows else "-")
            else:
                continue
            if not out or out[-1] != step:
                out.append(step)
    return out


def test_the_expert_cache_alone_gives_a_browser_its_memory_and_the_pool_is_untouched():
    """A browser takes 800 MiB for half a minute: the chunk cap goes down, then the
    expert cache gives the rest (a few of its 64 slots); the KV pool keeps every page and
    the prefix cache its pages. The browser gone, after the hold, the expert cache grows
    back to the plan, then the chunk cap."""
    ctl, model, trace = run_timeline(
        lambda t: DESKTOP + (800 * MiB if 10 <= t < 40 else 0), seconds=70, model=HybridEngineModel()
    )
    assert replan_steps(ctl) == ["chunk-", "experts-", "experts+", "chunk+"], ctl.decisions
    assert (ctl.expert_shrinks, ctl.expert_grows) == (1, 1)
    assert ctl.shrinks == ctl.grows == 0 and ctl.squeezes == 0
    assert {row[2] for row in trace} == {HYBRID_PAGES}, "the pool never moved"
    assert model.cached == 40, "the prefix cache was kept"
    shrink = next(a for d in ctl.decisions for a in d.actions if isinstance(a, NewExpertCache))
    assert 0 < shrink.num_slots < SLOTS
    # What the chunk cap did not give back, the expert cache did, in whole slots.
    low, _ = default_water_marks(TOTAL)
    assert all(h >= low for t, h, *_ in trace if 10.5 <= t < 40)
    grow_at = next(d.timestamp for d in ctl.decisions if any(
        isinstance(a, NewExpertCache) and a.grows for a in d.actions))
    assert grow_at >= 40 + 10, "the grow waited for the hold"
    assert (model.pages, model.slots, model.chunk) == (HYBRID_PAGES, SLOTS, CHUNK)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_game_empties_the_expert_cache_before_the_pool_shrinks_and_the_pool_grows_back_first(seed):
    """The desktop day on the hybrid engine: the game wants more than the chunk cap and
    the expert cache together hold, so the cache empties (every expert in host memory)
    and only then does the pool shrink; on the way back the pool regains the plan before
    the expert cache grows, and the chunk cap comes last."""
    ctl, model, trace = run_timeline(desktop_day(seed), model=HybridEngineModel())
    steps = replan_steps(ctl)
    assert steps[:2] == ["chunk-", "experts-"] and steps[2] in ("evict", "pool-"), steps
    # Every decision that shrank the pool had emptied the expert cache first.
    slots = SLOTS
    for d in ctl.decisions:
        for a in d.actions:
            if isinstance(a, NewExpertCache):
                slots = a.num_slots
            elif isinstance(a, NewPoolSize) and not a.grows:
                assert slots == 0, d
    assert ctl.shrinks >= 1 and ctl.expert_shrinks >= 1
    # Back: every grow of the expert cache comes once the pool is at the plan.
    pages = HYBRID_PAGES
    for d in ctl.decisions:
        for a in d.actions:
            if isinstance(a, NewPoolSize):
                pages = a.num_pages
            elif isinstance(a, NewExpertCache) and a.grows:
                assert pages == HYBRID_PAGES, d
    grows = [s for s in steps if s.endswith("+")]
    assert grows.index("pool+") < grows.index("experts+") < grows.index("chunk+"), steps
    assert ctl.squeezes == 0
    assert (model.pages, model.slots, model.chunk) == (HYBRID_PAGES, SLOTS, CHUNK), "the plan is whole again"


def test_a_squeeze_says_the_expert_cache_is_empty():
    ctl, model, trace = run_timeline(
        lambda t: DESKTOP + (int(0.75 * TOTAL) if 10 <= t < 50 else 0), seconds=90, model=HybridEngineModel()
    )
    (squeeze,) = [a for d in ctl.decisions for a in d.actions if isinstance(a, Squeeze)]
    assert "the expert cache empty" in squeeze.message
    assert min(row[2] for row in trace) == MIN_PAGES
    assert (model.pages, model.slots, model.chunk) == (HYBRID_PAGES, SLOTS, CHUNK)
