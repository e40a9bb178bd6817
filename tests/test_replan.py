"""The replan controller, torch-free, against a model of the engine's memory.

A scripted desktop timeline (a game takes 40% of a 16 GiB card, a browser spikes, both
leave) drives the controller: the KV pool follows the timeline, the decisions are
counted (no flapping), and the pool never goes below one request of the minimum
context: a squeeze is reported instead. ``--device-limit`` reads a larger card as one
of the limit's size. The timeline and the engine model live in ``replan_timeline.py``;
the expert cache's part of the replan is in ``test_replan_experts.py``, the watcher's
sources in ``test_vram_sources.py``.
"""

from __future__ import annotations

import random

import pytest
from replan_timeline import (
    APT,
    CHUNK,
    DESKTOP,
    MARGIN,
    MIN_PAGES,
    PAGE,
    PLANNED,
    RESERVE,
    TOTAL,
    EngineModel,
    desktop_day,
    directions,
    pages_at,
    run_timeline,
)

from engine.memory.plan import GiB, MiB
from service.vram.replan import (
    Decision,
    EmptyPrefixCache,
    NewChunkCap,
    NewPoolSize,
    PoolState,
    ReplanController,
    Squeeze,
    default_water_marks,
)
from service.vram.simulated import SimulatedSource
from service.vram.sources import VramSample, cpu_mode_sample


def test_water_marks_leave_the_plan_alone():
    low, high = default_water_marks(TOTAL)
    assert 0 < low < MARGIN < high
    ctl = ReplanController(low, high)
    assert ctl.grow_floor_bytes < MARGIN, "a grow must be able to reach the plan"
    with pytest.raises(ValueError):
        ReplanController(high, low)
    with pytest.raises(ValueError):
        ReplanController(0, 1, hold_s=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_pool_follows_a_desktop_day_without_flapping(seed):
    ctl, model, trace = run_timeline(desktop_day(seed))
    low, _ = default_water_marks(TOTAL)
    shown = [(d.timestamp, d.actions) for d in ctl.decisions]
    # The pool went down while others took memory and up once they left: one reversal.
    # The game's 6.4 GiB is taken as the pool lets go of it (NVML never shows negative
    # free memory), so its shrink comes in a few steps in its first second; the grows
    # come one per quiet hold: the browser gone, then the game.
    assert directions(ctl) == ["-", "+"], shown
    assert ctl.grows == 2 and ctl.squeezes == 0, shown
    assert ctl.shrinks <= 6, shown
    assert all(
        20 <= d.timestamp < 21.5 or 40 <= d.timestamp < 41.5
        for d in ctl.decisions
        if any(isinstance(a, NewPoolSize) and not a.grows for a in d.actions)
    )
    # The cheapest step came first: the chunk cap went down with the first shrink.
    first = ctl.decisions[0].actions
    assert isinstance(first[0], NewChunkCap) and first[0].tokens < CHUNK
    assert isinstance(first[-1], NewPoolSize)
    # The pool follows the timeline.
    game = int(0.4 * TOTAL)
    assert pages_at(trace, 10) == PLANNED
    assert PLANNED - pages_at(trace, 30) >= (game - 512 * MiB) // PAGE
    assert pages_at(trace, 42) < pages_at(trace, 30) - GiB // PAGE
    # Back to about the level before the spike: a grow may leave less headroom than a
    # shrink aims for (the band's lower quarter, not its middle), plus NVML's wobble.
    slack = (ctl.shrink_target_bytes - ctl.grow_floor_bytes + 2 * 48 * MiB) // PAGE
    assert pages_at(trace, 42) < pages_at(trace, 58) <= pages_at(trace, 30) + slack
    assert (model.pages, model.chunk) == (PLANNED, CHUNK), "grown back to the plan"
    # Never below one request of the minimum context.
    assert min(row[2] for row in trace) >= MIN_PAGES
    # Below low water only while the game and the browser were taking their memory.
    assert all(20 <= t < 21.5 or 40 <= t < 41.5 for t, h, *_ in trace if h < low)
    # Grows waited for the hold.
    grows = [
        d.timestamp
        for d in ctl.decisions
        if any(isinstance(a, NewPoolSize) and a.grows for a in d.actions)
    ]
    assert grows[0] >= 44 + 10 and grows[1] >= 60 + 10


def test_a_flickering_browser_costs_one_shrink():
    """A browser that takes 800 MiB for one second in every four: one shrink when it
    first shows, no grow while it keeps coming back (each gap is shorter than the hold),
    one grow once it has been gone for the hold."""

    def others(t):
        spiking = t < 80 and t % 4 < 1
        return DESKTOP + (800 * MiB if spiking else 0)

    ctl, model, trace = run_timeline(others, seconds=120)
    assert (ctl.shrinks, ctl.grows) == (1, 1)
    assert ctl.decisions[0].timestamp == 0.0
    assert ctl.decisions[-1].timestamp >= 77 + 10  # the last spike ended at 77 s
    assert model.pages == PLANNED


def test_noise_around_the_low_water_mark_moves_once():
    low, _ = default_water_marks(TOTAL)
    rng = random.Random(5)
    # The others settle where the headroom sits 30 MiB above low water, +-48 MiB.
    base = TOTAL - RESERVE - EngineModel().ours() - low - 30 * MiB

    ctl, _, _ = run_timeline(lambda t: base + rng.randint(-48 * MiB, 48 * MiB), seconds=200)
    assert len(ctl.decisions) == 1


def test_a_game_too_big_squeezes_once_and_never_goes_below_the_floor():
    def others(t):
        return DESKTOP + (int(0.75 * TOTAL) if 10 <= t < 50 else 0)

    ctl, model, trace = run_timeline(others, seconds=90)
    assert min(row[2] for row in trace) == MIN_PAGES
    squeezes = [a for d in ctl.decisions for a in d.actions if isinstance(a, Squeeze)]
    assert len(squeezes) == 1, "reported once per episode, not at every sample"
    assert squeezes[0].shortfall_bytes > 0
    assert "squeeze" in squeezes[0].message and "floor of 512 pages" in squeezes[0].message
    assert directions(ctl) == ["-", "+"]
    assert all(10 <= d.timestamp < 12 for d in ctl.decisions[:-1]), "no shrink once at the floor"
    assert (model.pages, model.chunk) == (PLANNED, CHUNK)
    # A second game later is a new episode: reported again.
    ctl2, _, _ = run_timeline(
        lambda t: DESKTOP + (int(0.75 * TOTAL) if 10 <= t < 30 or 60 <= t < 70 else 0), seconds=90
    )
    assert ctl2.squeezes == 2


def test_prefix_cache_is_evicted_before_a_shrink_that_needs_its_pages():
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high)
    model = EngineModel()
    src = SimulatedSource(TOTAL, [(0, DESKTOP + GiB)], ours_bytes=model.ours, display_attached=True)
    actions = ctl.decide(src.sample(at=0), model.state())
    assert [type(a) for a in actions] == [NewChunkCap, EmptyPrefixCache, NewPoolSize]
    assert "below the low water mark" in actions[-1].reason


def pool_of_1000_pages(prefill_chunk: int) -> PoolState:
    """A pool at its plan of 1,000 pages (100 at the least), the prefill chunk at
    ``prefill_chunk`` of the plan's 2,048 tokens, no activation price known."""
    return PoolState(pages=1000, planned_pages=1000, min_pages=100, page_bytes=PAGE,
                     prefill_chunk=prefill_chunk, planned_prefill_chunk=2048)


def test_unknown_activation_price_halves_the_chunk_and_counts_nothing():
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high, reserve=0)
    state = pool_of_1000_pages(prefill_chunk=2048)
    sample = VramSample(timestamp=0.0, gpu=True, total_bytes=TOTAL, free_bytes=low - 10 * PAGE)
    actions = ctl.decide(sample, state)
    assert actions[0] == NewChunkCap(1024, 2048, actions[0].reason)
    assert isinstance(actions[1], NewPoolSize) and actions[1].num_pages < 1000
    assert ctl.decisions == [Decision(0.0, low - 10 * PAGE, tuple(actions))]


def test_settle_time_after_a_resize_and_cpu_mode():
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high, reserve=GiB, settle_s=1.0)
    state = pool_of_1000_pages(prefill_chunk=256)

    def at(t, free):
        return VramSample(timestamp=t, gpu=True, total_bytes=TOTAL, free_bytes=free)

    assert ctl.decide(at(0.0, GiB + low - PAGE), state)
    assert ctl.decide(at(0.5, GiB + low - PAGE), state) == [], "waits for the samples to show it"
    assert ctl.decide(at(0.6, GiB - PAGE), state), "unless memory is needed now (headroom < 0)"
    assert ctl.decide(at(2.0, GiB + low - PAGE), state), "settled"
    assert ctl.decide(cpu_mode_sample("no GPU", 1.0), state) == []


def test_a_pinned_card_is_given_memory_fast():
    """A headless card (no reserve) where a job suddenly wants 6 GiB: NVML shows nothing
    free after every give-back (the job takes it at once), so the steps double; the
    demand is met within a second or two, and the overshoot comes back in one grow."""
    # Headless: the plan had the reserve too; no free pages and no prefix cache to give.
    planned = PLANNED + (RESERVE // PAGE)
    model = EngineModel(pages=planned, planned=planned, cached=0, free=0)
    ctl, model, trace = run_timeline(
        lambda t: DESKTOP + (6 * GiB if 10 <= t < 60 else 0), seconds=90, model=model, display=False
    )
    low, _ = default_water_marks(TOTAL)
    shrunk_at = [
        d.timestamp
        for d in ctl.decisions
        for a in d.actions
        if isinstance(a, NewPoolSize) and not a.grows
    ]
    assert 2 <= len(shrunk_at) <= 5 and shrunk_at[-1] < 11.5, (
        shrunk_at
    )  # a linear step would need ~17
    assert all(h >= low for t, h, *_ in trace if t >= 12), "the headroom is back"
    assert min(row[2] for row in trace) >= MIN_PAGES
    assert directions(ctl) == ["-", "+"]
    assert model.pages == planned


def test_a_device_limit_makes_the_pool_follow_another_process_on_a_large_card():
    """The engine planned for a 16 GiB card runs on an 80 GiB one (``--device-limit
    16GiB``); another process takes 6 GiB, then frees it. Read as a card of the limit, the
    pool shrinks by about what was taken and grows back to the plan; read as the whole
    card (the old, inconsistent rule), it never moves."""
    hog = [(0.0, DESKTOP), (10.0, DESKTOP + 6 * GiB), (40.0, DESKTOP)]
    ctl, model, trace = run_timeline(hog, card=80 * GiB, limit=TOTAL)
    pages = [row[2] for row in trace]
    # What was taken came out of the pool, less the headroom the plan left (the margin)
    # and what a lower prefill chunk gave back (at most the whole activation peak).
    assert min(pages) <= PLANNED - (6 * GiB - MARGIN - CHUNK * APT) // PAGE, min(pages)
    assert min(pages) >= MIN_PAGES
    assert model.pages == PLANNED and model.chunk == CHUNK
    assert 1 <= ctl.shrinks <= 3 and ctl.grows >= 1 and ctl.squeezes == 0
    during = [row[1] for row in trace if 15.0 <= row[0] < 40.0]
    assert min(during) >= 0, "the headroom came back while the other process held its 6 GiB"

    whole_ctl, whole, _ = run_timeline(hog, card=80 * GiB)
    assert whole_ctl.shrinks == 0 and whole.pages == PLANNED and whole.chunk == CHUNK
