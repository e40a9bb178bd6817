"""The VRAM watcher's sources and the replan controller, torch-free.

A scripted desktop timeline (a game takes 40% of a 16 GiB card, a browser spikes, both
leave) drives the controller against a model of the engine's memory: the KV pool
follows the timeline, the decisions are counted (no flapping), and the pool never goes
below one request of the minimum context: a squeeze is reported instead. With routed
experts in host memory, the GPU expert cache gives memory back before the pool and
takes it again after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import types
from dataclasses import dataclass

import msgspec
import pytest

from engine.memory.plan import GiB, MiB, reserve_for, safety_margin_for
from service.vram.replan import (
    Decision,
    EmptyPrefixCache,
    NewChunkCap,
    NewExpertCache,
    NewPoolSize,
    PoolState,
    ReplanController,
    Squeeze,
    default_water_marks,
)
from service.vram.simulated import SimulatedSource
from service.vram.sources import (
    REOPEN_INTERVAL_S,
    CardOfLimit,
    GpuProcess,
    NvmlSource,
    VramSample,
    as_card,
    cpu_mode_sample,
    nvml_index,
    resolve_reserve,
    watch,
)

# -- the sources ---------------------------------------------------------------------------


def test_simulated_source_plays_its_timeline():
    src = SimulatedSource(
        10 * GiB, [(5.0, 2 * GiB), (0.0, GiB), (8.0, 0)], ours_bytes=lambda: 3 * GiB
    )
    s = src.sample(at=6.0)
    assert (s.gpu, s.total_bytes, s.others_bytes, s.ours_bytes, s.free_bytes) == (
        True,
        10 * GiB,
        2 * GiB,
        3 * GiB,
        5 * GiB,
    )
    assert src.others_at(-1) == 0 and src.others_at(0) == GiB and src.others_at(9) == 0
    assert s.headroom(GiB) == 4 * GiB
    ramp = SimulatedSource(GiB, lambda t: int(t * MiB), clock=lambda: 100.0)
    assert ramp.sample().others_bytes == 100 * MiB and ramp.sample().timestamp == 100.0
    crowded = SimulatedSource(GiB, [(0, 2 * GiB)])
    assert crowded.sample(at=1).free_bytes == 0
    with pytest.raises(ValueError):
        SimulatedSource(0)
    with pytest.raises(ValueError):
        SimulatedSource(GiB, [(0, -1)])


def test_simulated_source_lists_processes():
    src = SimulatedSource(
        8 * GiB,
        [(0, 3 * GiB)],
        ours_bytes=GiB,
        own_pids=[10],
        processes=lambda t: [(10, "python", GiB), (20, "game", 2 * GiB), (30, "firefox", GiB)],
    )
    s = src.sample(at=0)
    assert [p.pid for p in s.processes] == [20, 10, 30]
    assert s.top_consumers == (GpuProcess(20, "game", 2 * GiB), GpuProcess(30, "firefox", GiB))
    assert s.held_by(30) == GiB and s.held_by(99) is None and s.pids_visible


def test_reserve_auto_depends_on_the_display():
    headless = SimulatedSource(16 * GiB).sample(at=0)
    desktop = SimulatedSource(16 * GiB, display_attached=True).sample(at=0)
    assert resolve_reserve(None, headless) == 0
    assert resolve_reserve("auto", desktop) == 512 * MiB + int(0.05 * 16 * GiB)
    assert resolve_reserve(None, desktop) == reserve_for(16 * GiB, True)
    assert resolve_reserve(GiB, desktop) == GiB
    assert resolve_reserve(None, cpu_mode_sample("no GPU")) == 0
    for bad in (-1, "lots", True):
        with pytest.raises(ValueError):
            resolve_reserve(bad, desktop)


def test_nvml_index_follows_cuda_visible_devices():
    assert nvml_index(0, {}) == 0
    assert nvml_index(1, {"CUDA_VISIBLE_DEVICES": "3,5"}) == 5
    assert nvml_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == 0


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, init_error=None, count=1, fail_reads=0, display=1):
    """A stand-in for the pynvml module: one 24 GiB card with three processes."""
    state = {"fail_reads": fail_reads, "shutdowns": 0}
    Proc = types.SimpleNamespace

    def init():
        if init_error:
            raise init_error

    def memory(handle):
        if state["fail_reads"]:
            state["fail_reads"] -= 1
            raise FakeNVMLError("GPU is lost")
        return types.SimpleNamespace(total=24 * GiB, free=10 * GiB, used=14 * GiB)

    def shutdown():
        state["shutdowns"] += 1

    mod = types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetName=lambda h: b"NVIDIA GeForce RTX 4090",
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            Proc(pid=100, usedGpuMemory=9 * GiB),
            Proc(pid=200, usedGpuMemory=3 * GiB),
        ],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [
            Proc(pid=300, usedGpuMemory=None),
            Proc(pid=400, usedGpuMemory=GiB),
        ],
        nvmlDeviceGetDisplayActive=lambda h: display,
        nvmlDeviceGetDisplayMode=lambda h: display,
    )
    mod.state = state
    return mod


def test_nvml_source_reads_the_card_by_pid():
    nvml = fake_nvml()
    src = NvmlSource(
        0, own_pids=lambda: {100, 1}, nvml=nvml, clock=lambda: 7.0, proc_name=lambda pid: f"p{pid}"
    )
    assert src.available and src.reason == ""
    s = src.sample()
    assert (s.gpu, s.device, s.timestamp) == (True, "NVIDIA GeForce RTX 4090 (GPU 0)", 7.0)
    assert (s.total_bytes, s.free_bytes, s.ours_bytes, s.others_bytes) == (
        24 * GiB,
        10 * GiB,
        9 * GiB,
        5 * GiB,
    )
    assert s.display_attached and s.pids_visible
    assert [p.pid for p in s.top_consumers] == [200, 400, 300]
    assert s.top_consumers[0] == GpuProcess(200, "p200", 3 * GiB)
    src.close()
    assert not src.available and nvml.state["shutdowns"] == 1
    assert src.sample().gpu is False


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (
            dict(init_error=FakeNVMLError("Driver Not Loaded")),
            "NVML is not available (Driver Not Loaded)",
        ),
        (dict(count=0), "NVML sees 0 GPU(s), none with index 0"),
    ],
)
def test_nvml_source_without_a_gpu_is_in_cpu_mode(kwargs, words):
    src = NvmlSource(0, nvml=fake_nvml(**kwargs))
    assert not src.available and words in src.reason and src.reason.startswith("no GPU, CPU mode")
    s = src.sample()
    assert (s.gpu, s.total_bytes, s.free_bytes) == (False, 0, 0) and words in s.reason


def test_nvml_source_without_pynvml_is_in_cpu_mode(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    src = NvmlSource()
    assert not src.available and "pynvml" in src.reason
    assert src.sample().gpu is False


def test_nvml_source_opens_a_gpu_that_appears_later():
    # The driver is still loading when the service starts: NVML fails to initialise twice.
    calls = {"init": 0}
    nvml = fake_nvml()
    ok_init = nvml.nvmlInit

    def init():
        calls["init"] += 1
        if calls["init"] <= 2:
            raise FakeNVMLError("Driver Not Loaded")
        ok_init()

    nvml.nvmlInit = init
    now = [100.0]
    src = NvmlSource(0, nvml=nvml, clock=lambda: now[0])
    assert not src.available and "Driver Not Loaded" in src.reason
    assert src.sample().gpu is False and calls["init"] == 1  # no retry before the interval
    now[0] += REOPEN_INTERVAL_S
    assert src.sample().gpu is False and calls["init"] == 2  # retried, failed again
    now[0] += REOPEN_INTERVAL_S
    s = src.sample()
    assert s.gpu is True and src.available and s.total_bytes == 24 * GiB
    src.close()
    now[0] += REOPEN_INTERVAL_S
    assert src.sample().gpu is False and calls["init"] == 3  # closed: never reopened


def test_nvml_source_survives_a_failed_read():
    src = NvmlSource(0, nvml=fake_nvml(fail_reads=1))
    bad = src.sample()
    assert bad.gpu is False and "GPU is lost" in bad.reason and src.available
    assert src.sample().gpu is True  # the next read works again


def test_the_real_nvml_never_raises():
    src = NvmlSource()
    s = src.sample()
    assert s.gpu == src.available
    if not s.gpu:
        assert s.reason.startswith("no GPU, CPU mode")
    src.close()


def test_watch_samples_at_its_rate_and_stops_in_cpu_mode():
    async def collect(source, n):
        out = []
        async for s in watch(source, hz=200):
            out.append(s)
            if len(out) == n:
                break
        return out

    got = asyncio.run(collect(SimulatedSource(GiB, [(0, MiB)]), 3))
    assert len(got) == 3 and all(s.gpu for s in got)
    assert got[0].timestamp < got[2].timestamp
    cpu = NvmlSource(nvml=fake_nvml(count=0))
    assert [s.gpu for s in asyncio.run(collect(cpu, 5))] == [False]
    with pytest.raises(ValueError):
        asyncio.run(_first(watch(cpu, hz=0)))


async def _first(agen):
    async for s in agen:
        return s


# -- the controller against a model of the engine ------------------------------------------

TOTAL = 16 * GiB
PAGE = 2 * MiB
WEIGHTS = 4 * GiB
RUNTIME = 512 * MiB
APT = 256 << 10  # activation bytes per token of prefill chunk
CHUNK = 2048
DESKTOP = GiB
RESERVE = reserve_for(TOTAL, True)
MARGIN = safety_margin_for(TOTAL)
PLANNED = (TOTAL - DESKTOP - RESERVE - MARGIN - WEIGHTS - RUNTIME - CHUNK * APT) // PAGE
MIN_PAGES = GiB // PAGE + 1  # one request of the minimum context


@dataclass
class EngineModel:
    """The engine's memory: weights, runtime, the activation peak at the chunk cap, the
    KV pool; applies the controller's actions at once, as the worker would."""

    pages: int = PLANNED
    chunk: int = CHUNK
    cached: int = 40

    def ours(self) -> int:
        return WEIGHTS + RUNTIME + self.chunk * APT + self.pages * PAGE

    def state(self) -> PoolState:
        return PoolState(
            pages=self.pages,
            planned_pages=PLANNED,
            min_pages=MIN_PAGES,
            page_bytes=PAGE,
            prefill_chunk=self.chunk,
            planned_prefill_chunk=CHUNK,
            activation_bytes_per_token=APT,
            free_pages=10,
            cached_pages=self.cached,
        )

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, NewChunkCap):
                assert a.before == self.chunk
                self.chunk = a.tokens
            elif isinstance(a, EmptyPrefixCache):
                self.cached = 0
            elif isinstance(a, NewPoolSize):
                assert a.before == self.pages
                self.pages = a.num_pages


def run_timeline(
    others, *, seconds=100.0, hz=4.0, hold_s=10.0, model=None, display=True, card=TOTAL, limit=None
):
    """Sample ``others(t)`` at ``hz`` for ``seconds`` on a card of ``card`` bytes, read as
    one of ``limit`` bytes when given (``--device-limit``); returns (controller, model,
    trace) with trace rows ``(t, headroom before acting, pages after, chunk after,
    actions)``."""
    model = model or EngineModel()
    src = SimulatedSource(card, others, ours_bytes=model.ours, display_attached=display)
    if limit is not None:
        src = CardOfLimit(src, limit)
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high, hold_s=hold_s)
    trace = []
    for i in range(int(seconds * hz)):
        t = i / hz
        sample = src.sample(at=t)
        actions = ctl.decide(sample, model.state())
        model.apply(actions)
        trace.append(
            (t, sample.headroom(resolve_reserve(None, sample)), model.pages, model.chunk, actions)
        )
    return ctl, model, trace


def desktop_day(seed: int = 0):
    """A game takes 40% of the card at 20 s, a browser spikes by 1.5 GiB at 40-44 s, both
    leave at 60 s; NVML's numbers wobble by up to 48 MiB at every sample."""
    rng = random.Random(seed)

    def others(t: float) -> int:
        b = DESKTOP
        if 20 <= t < 60:
            b += int(0.4 * TOTAL)
        if 40 <= t < 44:
            b += 3 * GiB // 2
        return b + rng.randint(-48 * MiB, 48 * MiB)

    return others


def pages_at(trace, t):
    return next(row[2] for row in trace if row[0] >= t)


def test_water_marks_leave_the_plan_alone():
    low, high = default_water_marks(TOTAL)
    assert 0 < low < MARGIN < high
    ctl = ReplanController(low, high)
    assert ctl.grow_floor_bytes < MARGIN, "a grow must be able to reach the plan"
    with pytest.raises(ValueError):
        ReplanController(high, low)
    with pytest.raises(ValueError):
        ReplanController(0, 1, hold_s=-1)


def directions(ctl) -> list[str]:
    """The pool's resizes in order, ``"-"`` for a shrink and ``"+"`` for a grow, runs of
    the same direction merged: every change of sign is a reversal."""
    out: list[str] = []
    for d in ctl.decisions:
        for a in d.actions:
            if isinstance(a, NewPoolSize):
                sign = "+" if a.grows else "-"
                if not out or out[-1] != sign:
                    out.append(sign)
    return out


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


def test_unknown_activation_price_halves_the_chunk_and_counts_nothing():
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high, reserve=0)
    state = PoolState(
        pages=1000,
        planned_pages=1000,
        min_pages=100,
        page_bytes=PAGE,
        prefill_chunk=2048,
        planned_prefill_chunk=2048,
    )
    sample = VramSample(timestamp=0.0, gpu=True, total_bytes=TOTAL, free_bytes=low - 10 * PAGE)
    actions = ctl.decide(sample, state)
    assert actions[0] == NewChunkCap(1024, 2048, actions[0].reason)
    assert isinstance(actions[1], NewPoolSize) and actions[1].num_pages < 1000
    assert ctl.decisions == [Decision(0.0, low - 10 * PAGE, tuple(actions))]


def test_settle_time_after_a_resize_and_cpu_mode():
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high, reserve=GiB, settle_s=1.0)
    state = PoolState(
        pages=1000,
        planned_pages=1000,
        min_pages=100,
        page_bytes=PAGE,
        prefill_chunk=256,
        planned_prefill_chunk=2048,
    )

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
    model = EngineModel(pages=PLANNED + (RESERVE // PAGE))  # headless: the plan had the reserve too
    planned = model.pages

    def state():
        return PoolState(
            pages=model.pages,
            planned_pages=planned,
            min_pages=MIN_PAGES,
            page_bytes=PAGE,
            prefill_chunk=model.chunk,
            planned_prefill_chunk=CHUNK,
            activation_bytes_per_token=APT,
        )

    model.state = state
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


# -- --device-limit: a card of that size, for the watcher as for the plan ------------------


def test_a_device_limit_reads_the_card_as_one_of_that_size():
    """The plan counts other processes' memory against ``--device-limit``; the watcher's
    samples do the same: everything in use counts against the limit, as on a real card
    of that size, and free memory may read below zero when the real, larger card let the
    others take more. A limit above the card, no limit, or CPU mode change nothing."""
    sample = VramSample(
        timestamp=1.0, gpu=True, total_bytes=80 * GiB, free_bytes=58 * GiB,
        ours_bytes=15 * GiB, others_bytes=7 * GiB,
    )
    card = as_card(sample, 16 * GiB)
    assert (card.total_bytes, card.device_limit_bytes) == (16 * GiB, 16 * GiB)
    assert card.free_bytes == 16 * GiB - 22 * GiB  # 6 GiB over the card
    assert (card.ours_bytes, card.others_bytes) == (sample.ours_bytes, sample.others_bytes)
    assert as_card(sample, None) is sample and as_card(sample, 96 * GiB) is sample
    cpu = cpu_mode_sample("no GPU")
    assert as_card(cpu, 16 * GiB) is cpu
    # Memory in use that NVML attributes to nobody counts as well: free drops by the
    # part of the card beyond the limit, whatever holds the rest.
    unattributed = msgspec.structs.replace(sample, free_bytes=40 * GiB)
    assert as_card(unattributed, 30 * GiB).free_bytes == 40 * GiB - 50 * GiB


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
