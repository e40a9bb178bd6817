"""Fast checks of the wiring between the engine worker, the supervisor, the VRAM watcher
and the event hub (issues 5 and 6), without a server: the replan commands cross the
pipe and the worker carries them out; engine events become ``replan`` and
``request_error`` events; the watcher turns a simulated timeline into commands; the
timeline file, the settings and ``headroom token``.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from service_harness import engine_info as info

from engine.wire import ipc
from engine.memory.plan import LedgerEntry, MemoryPlan
from engine.wire.messages import (
    BY_CONTROL,
    BY_WATCHER,
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_EXPERT_CACHE,
    REPLAN_RESIZE_POOL,
    EngineInfo,
    EngineStats,
    OomEvent,
    Replanned,
    ReplanWanted,
    ResizeResult,
)
from engine.common.units import GiB, MiB
from service.common.settings import SettingsError
from service.common.settings_sources import resolve
from service.events.hub import EventHub
from service.control.actions import CONTROL_REASON
from service.supervision.engine_events_to_ui import EngineEventsToUI, bytes_asked
from service.common.engine_states import State
from service.vram.simulated import SimulatedSource, TimelineError, load_timeline, simulated_ours_bytes
from service.vram.watcher import VramWatcher

STATS = EngineStats(
    running=0,
    waiting=0,
    free_pages=100,
    total_pages=100,
    cached_pages=7,
    prefix_hit_tokens=0,
    prefix_lookup_tokens=0,
    finished=0,
    aborted=0,
    failed=0,
)


def pool_stats(
    pages: int, *, min_pages: int, activation_bytes_per_token: int, max_context_tokens: int
) -> ipc.PoolStats:
    """A worker's pool at its plan: ``pages`` pages of 1 MiB (the null page among them, so
    one fewer free), a 2048-token prefill chunk (256 at the least), an empty prefix
    cache, 1 GiB besides the pool."""
    return ipc.PoolStats(
        pages=pages,
        planned_pages=pages,
        min_pages=min_pages,
        page_bytes=MiB,
        pool_bytes=pages * MiB,
        prefill_chunk=2048,
        planned_prefill_chunk=2048,
        min_prefill_chunk=256,
        activation_bytes_per_token=activation_bytes_per_token,
        free_pages=pages - 1,
        cached_pages=0,
        max_context_tokens=max_context_tokens,
        fixed_bytes=GiB,
    )


# -- IPC ---------------------------------------------------------------------------------------


def test_replan_commands_and_answers_cross_the_pipe():
    pool = pool_stats(101, min_pages=33, activation_bytes_per_token=1024, max_context_tokens=1600)
    for command in (
        ipc.SetPrefillChunk(seq=1, tokens=512, reason="r"),
        ipc.EvictPrefixCache(seq=2, reason="r"),
        ipc.EvictPrefixCache(seq=3, origin=BY_CONTROL),
        ipc.ResizePool(seq=4, num_pages=50, reason="r"),
        ipc.ResizeExpertCache(seq=5, num_slots=0, reason="r"),
    ):
        assert ipc.to_worker_decoder.decode(ipc.encode(command)) == command
    replanned = Replanned(
        action=REPLAN_RESIZE_POOL,
        reason="r",
        before_pages=101,
        after_pages=50,
        before_bytes=101 * MiB,
        after_bytes=50 * MiB,
        duration_ms=3.0,
        max_prefill_tokens=2048,
        max_context_tokens=784,
        preempted=["a"],
    )
    for message in (
        ipc.EngineEvents([replanned, ReplanWanted(reason="oom", new_max_prefill_tokens=1024)]),
        ipc.Heartbeat(stats=STATS, pool=pool),
        ipc.ControlDone(
            seq=4,
            ok=True,
            message="done",
            stats=STATS,
            pool=pool,
            result=ResizeResult(before_pages=101, after_pages=50, before_bytes=1, after_bytes=1),
        ),
    ):
        assert ipc.from_worker_decoder.decode(ipc.encode(message)) == message


class FakeConn:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(ipc.from_worker_decoder.decode(data))


class ResizableEngine:
    """The parts of engine.core.engine.Engine the worker's replan handling touches."""

    def __init__(self) -> None:
        self.pool = type("Pool", (), {"num_pages": 101, "nbytes": 101 * MiB})()
        self.scheduler = type("Sched", (), {"max_prefill_tokens": 2048})()
        self.knobs = type("Knobs", (), {"max_prefill_tokens": 2048})()
        self.max_context_tokens = 1600
        self.kv_page_bytes = MiB
        self.plan = None
        self.events: list[Any] = []

    def stats(self) -> EngineStats:
        return STATS

    def min_kv_pool_pages(self) -> int:
        return 33

    def resize_kv_pool(self, num_pages: int, *, reason: str = "", origin: str = BY_WATCHER) -> ResizeResult:
        if num_pages < 2:
            raise ValueError("at least 2 pages")
        before = self.pool.num_pages
        self.pool.num_pages = num_pages
        self.events.append(
            Replanned(
                action=REPLAN_RESIZE_POOL,
                reason=reason,
                origin=origin,
                before_pages=before,
                after_pages=num_pages,
                before_bytes=before * MiB,
                after_bytes=num_pages * MiB,
                duration_ms=1.0,
                max_prefill_tokens=2048,
                max_context_tokens=(num_pages - 1) * 16,
            )
        )
        return ResizeResult(
            before_pages=before,
            after_pages=num_pages,
            before_bytes=before * MiB,
            after_bytes=num_pages * MiB,
            max_context_tokens=(num_pages - 1) * 16,
        )

    def set_prefill_chunk(self, tokens: int, *, reason: str = "", origin: str = BY_WATCHER) -> int:
        self.scheduler.max_prefill_tokens = min(tokens, 2048)
        return self.scheduler.max_prefill_tokens

    def evict_prefix_cache(self, *, reason: str = "", origin: str = BY_WATCHER) -> int:
        return 0

    def drain_events(self) -> list[Any]:
        out, self.events = self.events, []
        return out


def test_the_worker_carries_out_replan_commands_and_answers_after_the_events():
    from engine.worker.process import _replan

    engine, conn = ResizableEngine(), FakeConn()
    _replan(conn, engine, ipc.ResizePool(seq=7, num_pages=60, reason="game"), 101)
    events, done = conn.sent
    assert isinstance(events, ipc.EngineEvents) and events.events[0].after_pages == 60
    assert events.events[0].origin == BY_WATCHER
    assert isinstance(done, ipc.ControlDone) and done.seq == 7 and done.ok
    assert done.pool is not None and done.pool.pages == 60 and done.pool.planned_pages == 101
    assert done.result is not None and done.result.after_pages == 60
    assert "100 -> 59 pages" in done.message

    conn.sent.clear()
    _replan(conn, engine, ipc.ResizePool(seq=11, num_pages=50, origin=BY_CONTROL), 101)
    assert conn.sent[0].events[0].origin == BY_CONTROL  # who asked comes back typed

    conn.sent.clear()
    _replan(conn, engine, ipc.ResizePool(seq=8, num_pages=1), 101)
    (refused,) = conn.sent  # nothing changed: no events
    assert not refused.ok and "at least 2 pages" in refused.message

    conn.sent.clear()
    _replan(conn, engine, ipc.SetPrefillChunk(seq=9, tokens=512), 101)
    assert conn.sent[-1].ok and conn.sent[-1].pool.prefill_chunk == 512

    conn.sent.clear()
    plain = type("PlainEngine", (), {"stats": lambda self: STATS})()  # cannot resize
    _replan(conn, plain, ipc.EvictPrefixCache(seq=10, origin=BY_CONTROL), 0)
    (answer,) = conn.sent
    assert not answer.ok and answer.pool is None


# -- engine events -> hub events -------------------------------------------------------------


@dataclass
class StubLink:
    stats: EngineStats | None = STATS
    in_flight: int = 0


@dataclass
class StubSupervisor:
    info: EngineInfo | None = field(default_factory=info)
    link: StubLink = field(default_factory=StubLink)


def services_with_hub() -> tuple[EngineEventsToUI, EventHub]:
    hub = EventHub()
    return EngineEventsToUI(hub, StubSupervisor()), hub


def replanned(action: str, before: int, after: int, **kw: Any) -> Replanned:
    return Replanned(
        action=action,
        reason=kw.pop("reason", "headroom low"),
        before_pages=before,
        after_pages=after,
        before_bytes=before * MiB,
        after_bytes=after * MiB,
        duration_ms=12.0,
        max_prefill_tokens=kw.pop("chunk", 2048),
        max_context_tokens=2048,
        **kw,
    )


def test_engine_events_become_replan_and_request_error_events():
    svc, hub = services_with_hub()
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 101, 51, preempted=["x"]))
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 51, 101))
    svc.record_engine_event(
        replanned(REPLAN_RESIZE_POOL, 101, 41, reason=f"{CONTROL_REASON}: KV cache 40 MiB", origin=BY_CONTROL)
    )
    svc.record_engine_event(replanned(REPLAN_PREFILL_CHUNK, 41, 41, chunk=256))
    svc.record_engine_event(replanned(REPLAN_EVICT_PREFIX_CACHE, 41, 41, evicted_pages=5))
    svc.record_engine_event(
        replanned(REPLAN_EVICT_PREFIX_CACHE, 41, 41, reason=CONTROL_REASON, origin=BY_CONTROL)
    )
    svc.record_engine_event(ReplanWanted(reason="oom in a step", new_max_prefill_tokens=1024))
    svc.record_engine_event(
        OomEvent(
            request_id="r-0",
            phase="prefill",
            tokens_in_step=512,
            action="retry_smaller_chunk",
            message="CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0 ...)",
        )
    )
    snap = hub.snapshot()
    actions = [r.action for r in snap.replans]
    assert actions == [
        "shrink_kv",
        "grow_kv",
        "set_kv_cache",
        "lower_chunk_cap",
        "evict_prefix_cache",
        "clear_prefix_cache",
        "lower_chunk_cap",
    ]
    shrink = snap.replans[0]
    assert (shrink.before.num_pages, shrink.after.num_pages) == (100, 50)
    assert shrink.duration_s == pytest.approx(0.012)
    assert "1 requests preempted" in shrink.reason
    evict = snap.replans[4]
    assert (evict.before.prefix_cache_pages, evict.after.prefix_cache_pages) == (7, 2)
    (error,) = snap.request_errors
    assert error.code == "out_of_memory" and error.action == "retry_smaller_chunk"
    assert error.bytes_asked == 20 * MiB
    assert snap.counters is not None and snap.counters.replans == 7
    assert snap.counters.oom_steps == 1 and snap.counters.engine == STATS
    # Counters go out only when they change.
    seq = hub.seq
    svc.publish_counters(STATS)
    assert hub.seq == seq


def test_a_context_that_grows_back_with_the_pool_publishes_a_plan():
    """Fit-the-card lowered the context to 1,024 tokens; the pool growing back to the
    full context publishes a ``plan`` whose note is gone, a shrink below it one whose
    note says so, and the supervisor's info carries the same plan."""
    from service.supervision.engine_events_to_ui import info_after

    plan = MemoryPlan(
        device="sim", simulated=True, ledger=[], budget_bytes=3 * GiB, fixed_bytes=GiB, kv_pool_bytes=64 * MiB,
        num_pages=64, page_size=16, max_context_tokens=1024, min_context_tokens=512, fits=True, shortfall_bytes=0,
        suggestions=[], max_prefill_tokens=2048, max_running_requests=8, wanted_context_tokens=2048,
        context_note="context 2,048 -> 1,024 tokens: 1.0 GiB held by other processes",
    )
    svc, hub = services_with_hub()
    svc.supervisor.info = info(max_context_tokens=1024, num_pages=65, plan=plan)
    grow = replanned(REPLAN_RESIZE_POOL, 65, 129, reason="headroom back")
    svc.record_engine_event(grow)
    published = hub.snapshot().plan
    assert published is not None and published.plan is not None
    assert published.plan.max_context_tokens == 2048 and published.plan.num_pages == 128
    assert published.plan.context_note == "" and not published.plan.context_lowered
    svc.supervisor.info = info_after(svc.supervisor.info, grow)
    assert svc.supervisor.info.plan == published.plan

    shrink = msgspec.structs.replace(replanned(REPLAN_RESIZE_POOL, 129, 49, reason="another app"),
                                     max_context_tokens=768)
    svc.record_engine_event(shrink)
    after = hub.snapshot().plan.plan
    assert after.max_context_tokens == 768 and after.context_note == "context 2,048 -> 768 tokens: another app"
    # A resize that leaves the context where it was publishes no plan.
    seq = hub.seq
    svc.supervisor.info = info_after(svc.supervisor.info, shrink)
    svc.record_engine_event(msgspec.structs.replace(replanned(REPLAN_RESIZE_POOL, 49, 50), max_context_tokens=768))
    assert hub.snapshot().plan.plan == after and hub.seq > seq


def test_bytes_asked_reads_torchs_message():
    assert bytes_asked("Tried to allocate 1.50 GiB") == int(1.5 * GiB)
    assert bytes_asked("tried to allocate 512 B") == 512
    assert bytes_asked("out of memory") is None


# -- the watcher ----------------------------------------------------------------------------


class FakeLink:
    """Applies commands to a pool at once, like the worker, and records them."""

    def __init__(self, pool: ipc.PoolStats) -> None:
        self.pool: ipc.PoolStats | None = pool
        self.commands: list[Any] = []

    async def run_command(self, kind, *, timeout_s: float = 30.0, **fields: Any):
        self.commands.append((kind.__name__, fields))
        assert self.pool is not None
        if kind is ipc.ResizePool:
            self.pool = msgspec.structs.replace(self.pool, pages=fields["num_pages"])
        elif kind is ipc.ResizeExpertCache:
            self.pool = msgspec.structs.replace(self.pool, expert_slots=fields["num_slots"])
        elif kind is ipc.SetPrefillChunk:
            self.pool = msgspec.structs.replace(self.pool, prefill_chunk=fields["tokens"])
        return ipc.ControlDone(seq=1, ok=True, message="ok", stats=STATS, pool=self.pool)


class FakeSupervisor:
    """A ready worker's keeper whose link is a :class:`FakeLink`."""

    def __init__(self, pool: ipc.PoolStats) -> None:
        self.state = State.READY
        self.info = info(device="cuda:0")
        self.link = FakeLink(pool)
        self.worker_alive = True


def test_the_watcher_follows_a_simulated_timeline_with_commands():
    pool = pool_stats(
        2001, min_pages=129, activation_bytes_per_token=16 << 10, max_context_tokens=2048
    )
    sup = FakeSupervisor(pool)
    now = [0.0]
    total = 4 * GiB
    # Reserve 0 (no display), so the plan left about the safety margin free.
    margin = total - simulated_ours_bytes(pool)
    source = SimulatedSource(
        total,
        [(0.0, margin - 200 * MiB), (2.0, margin + 1000 * MiB), (6.0, margin - 200 * MiB)],
        ours_bytes=lambda: simulated_ours_bytes(sup.link.pool),
        clock=lambda: now[0],
    )
    watcher = VramWatcher(sup, None, source, kind="simulated", hold_s=1.0)  # type: ignore[arg-type]

    async def play() -> list[int]:
        pages = []
        while now[0] < 10.0:
            await watcher.step(source.sample())
            assert sup.link.pool is not None
            pages.append(sup.link.pool.pages)
            now[0] += 0.25
        return pages

    pages = asyncio.run(play())
    kinds = [k for k, _ in sup.link.commands]
    assert kinds[0] == "SetPrefillChunk" and "ResizePool" in kinds
    assert min(pages) < 2001 and pages[-1] == 2001  # shrank, then grew back to the plan
    assert sup.link.pool is not None and sup.link.pool.prefill_chunk == 2048
    assert kinds.count("ResizePool") <= 5
    # A ceiling asked for through the control API caps the grow.
    watcher.kv_ceiling_pages = 1500
    assert watcher.pool_state(sup.link.pool).planned_pages == 1500


def test_the_watcher_leaves_a_cpu_engine_alone_on_a_real_gpu():
    sup = FakeSupervisor(
        ipc.PoolStats(
            pages=200,
            planned_pages=200,
            min_pages=10,
            page_bytes=MiB,
            pool_bytes=200 * MiB,
            prefill_chunk=2048,
            planned_prefill_chunk=2048,
            min_prefill_chunk=256,
            activation_bytes_per_token=0,
            free_pages=199,
            cached_pages=0,
            max_context_tokens=2048,
        )
    )
    sup.info = info(device="cpu")
    full = SimulatedSource(GiB, [(0.0, GiB)], clock=lambda: 0.0)  # nothing free at all
    watcher = VramWatcher(sup, None, full, kind="nvml")  # type: ignore[arg-type]
    assert asyncio.run(watcher.step(full.sample())) == []
    assert sup.link.commands == []


# -- the timeline file, settings, headroom token ------------------------------------------------


def test_timeline_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"total": "4GiB", "display": False, "steps": [[0, 0], [2, "40%"], [5, "1GiB"]]})
    )
    timeline = load_timeline(path)
    assert timeline.total_bytes == 4 * GiB and timeline.display is False
    assert timeline.steps == ((0.0, 0), (2.0, int(0.4 * 4 * GiB)), (5.0, GiB))
    assert (timeline.start, timeline.baseline) == ("ready", "kept")
    path.write_text(json.dumps({"baseline": "replaced", "steps": [[0, "1GiB"], [9, 0]]}))
    assert load_timeline(path).baseline == "replaced"
    path.write_text(json.dumps({"steps": [[0, "40%"]]}))
    assert load_timeline(path, default_total=GiB).steps == ((0.0, int(0.4 * GiB)),)
    for bad in ('{"steps": [[0, "40%"]]}', '{"steps": [[0]]}', "not json", '{"start": "x"}',
                '{"baseline": "gone"}'):
        path.write_text(bad)
        with pytest.raises(TimelineError, match=str(path.name)):
            load_timeline(path)
    with pytest.raises(TimelineError, match="cannot read"):
        load_timeline(tmp_path / "missing.json")


def test_vram_and_replan_settings(tmp_path):
    config = tmp_path / "c.toml"
    config.touch()
    s = resolve({}, env={}, config_path=config)
    assert (s.vram_source, s.vram_hz, s.replan_hold) == ("nvml", 4.0, 10.0)
    assert s.replan_low is None and s.replan_high is None
    s = resolve(
        {"vram_source": "simulated", "device_total": "4GiB", "replan_low": "64MiB"},
        env={"HEADROOM_REPLAN_HIGH": "512MiB"},
        config_path=config,
    )
    assert (s.replan_low, s.replan_high) == (64 * MiB, 512 * MiB)
    for flags, message in (
        ({"vram_source": "gpu"}, "not one of nvml, simulated"),
        ({"vram_source": "simulated"}, "needs --device-total"),
        ({"vram_timeline": "t.json"}, "needs --vram-source simulated"),
        ({"vram_hz": 0.0}, "must be positive"),
        ({"replan_low": "1GiB", "replan_high": "512MiB"}, "above --replan-low"),
    ):
        with pytest.raises(SettingsError, match=message):
            resolve(flags, env={}, config_path=config)


def test_serve_help_documents_the_vram_options():
    from service.cli.commands import main

    out = CliRunner().invoke(main, ["serve", "--help"], env={"HEADROOM_CONFIG": os.devnull}).output
    for flag in ("--vram-source", "--vram-timeline", "--vram-hz", "--replan-low", "--replan-high"):
        assert flag in out
    assert "HEADROOM_REPLAN_HOLD" in out


def test_headroom_token_prints_the_file_and_the_dashboard_address(tmp_path):
    from service.cli.commands import main

    env = {"HEADROOM_CONFIG": os.devnull, "HEADROOM_CONFIG_DIR": str(tmp_path / "cfg")}
    result = CliRunner().invoke(main, ["token", "--port", "9123"], env=env)
    assert result.exit_code == 0, result.output
    token = (tmp_path / "cfg" / "token").read_text().strip()
    assert f"token file: {tmp_path / 'cfg' / 'token'}" in result.output
    assert f"http://127.0.0.1:9123/ui/#token={token}" in result.output
    assert "?token=" not in result.output  # a fragment never reaches the server
    assert stat.S_IMODE((tmp_path / "cfg" / "token").stat().st_mode) == 0o600
    # The same token the next time.
    again = CliRunner().invoke(main, ["token"], env=env)
    assert f"#token={token}" in again.output


def test_planned_page_bytes_come_from_the_plan():
    from engine.worker.process import pool_stats

    engine = ResizableEngine()
    engine.plan = MemoryPlan(
        device="sim",
        simulated=True,
        ledger=[LedgerEntry("prefill activation peak", 2048 * 1000, "-", "est")],
        budget_bytes=3 * GiB,
        fixed_bytes=GiB,
        kv_pool_bytes=100 * 512 * 1024,
        num_pages=100,
        page_size=16,
        max_context_tokens=1600,
        min_context_tokens=512,
        fits=True,
        shortfall_bytes=0,
        suggestions=[],
        max_prefill_tokens=2048,
        max_running_requests=8,
    )
    pool = pool_stats(engine, STATS, 101)
    assert pool is not None
    assert pool.page_bytes == 512 * 1024  # the plan's, not the CPU pool's
    assert pool.fixed_bytes == GiB and pool.activation_bytes_per_token == 1000
    assert simulated_ours_bytes(pool) == GiB + 100 * 512 * 1024


# -- the GPU expert cache in the replan -------------------------------------------------------


def test_the_watcher_gives_the_expert_cache_back_before_the_pool_and_takes_it_again():
    """A hybrid engine (48 expert slots of 8 MiB in its plan) on a simulated card:
    another process takes 250 MiB; the chunk cap and the expert cache give it back (the
    pool is untouched), and once it leaves the expert cache grows back to the plan. The
    simulated card counts the slots given back."""
    pool = msgspec.structs.replace(
        pool_stats(2001, min_pages=129, activation_bytes_per_token=16 << 10, max_context_tokens=2048),
        expert_slots=48, planned_expert_slots=48, max_expert_slots=64, expert_slot_bytes=8 * MiB,
    )
    assert simulated_ours_bytes(msgspec.structs.replace(pool, expert_slots=40)) == simulated_ours_bytes(pool) - 64 * MiB
    sup = FakeSupervisor(pool)
    now = [0.0]
    total = 4 * GiB
    margin = total - simulated_ours_bytes(pool)
    source = SimulatedSource(
        total,
        [(0.0, margin - 200 * MiB), (2.0, margin + 50 * MiB), (6.0, margin - 200 * MiB)],
        ours_bytes=lambda: simulated_ours_bytes(sup.link.pool),
        clock=lambda: now[0],
    )
    watcher = VramWatcher(sup, None, source, kind="simulated", hold_s=1.0)  # type: ignore[arg-type]

    async def play() -> list[int]:
        slots = []
        while now[0] < 10.0:
            await watcher.step(source.sample())
            slots.append(sup.link.pool.expert_slots)
            now[0] += 0.25
        return slots

    slots = asyncio.run(play())
    kinds = [k for k, _ in sup.link.commands]
    assert "ResizePool" not in kinds, kinds
    assert kinds.index("SetPrefillChunk") < kinds.index("ResizeExpertCache"), kinds
    assert min(slots) < 48 and slots[-1] == 48, slots
    assert sup.link.pool.pages == 2001 and sup.link.pool.prefill_chunk == 2048
    shrink = next(f for k, f in sup.link.commands if k == "ResizeExpertCache")
    assert shrink["origin"] == BY_WATCHER and "below the low water mark" in shrink["reason"]
    # A size asked for through the control API caps the grow (never above every expert).
    watcher.expert_ceiling_slots = 20
    assert watcher.pool_state(sup.link.pool).planned_expert_slots == 20
    watcher.expert_ceiling_slots = 500
    assert watcher.pool_state(sup.link.pool).planned_expert_slots == 64


def test_expert_cache_resizes_become_replan_events_with_the_slots():
    svc, hub = services_with_hub()
    sizes = dict(before_expert_slots=48, before_expert_bytes=48 * 8 * MiB)
    svc.record_engine_event(replanned(REPLAN_RESIZE_EXPERT_CACHE, 101, 101, **sizes, after_expert_slots=10,
                                      after_expert_bytes=80 * MiB))
    svc.record_engine_event(replanned(REPLAN_RESIZE_EXPERT_CACHE, 101, 101, before_expert_slots=10,
                                      before_expert_bytes=80 * MiB, after_expert_slots=48,
                                      after_expert_bytes=48 * 8 * MiB))
    svc.record_engine_event(replanned(REPLAN_RESIZE_EXPERT_CACHE, 101, 101, **sizes, after_expert_slots=0,
                                      reason=f"{CONTROL_REASON}: expert cache 0 B", origin=BY_CONTROL))
    svc.record_engine_event(replanned(REPLAN_RESIZE_POOL, 101, 51))  # an engine without host experts
    shrink, grow, by_hand, pool = hub.snapshot().replans
    assert [r.action for r in (shrink, grow, by_hand)] == ["shrink_expert_cache", "grow_expert_cache",
                                                           "set_expert_cache"]
    assert (shrink.before.expert_cache_slots, shrink.after.expert_cache_slots) == (48, 10)
    assert (shrink.before.expert_cache_bytes, shrink.after.expert_cache_bytes) == (384 * MiB, 80 * MiB)
    assert shrink.before.num_pages == shrink.after.num_pages == 100, "the pool is untouched"
    assert by_hand.after.expert_cache_slots == 0
    assert pool.before.expert_cache_slots is None and pool.after.expert_cache_bytes is None


def test_the_control_api_sizes_the_expert_cache_in_whole_slots_and_sets_the_ceiling():
    from service.control.actions import SupervisorControl

    pool = msgspec.structs.replace(
        pool_stats(201, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048),
        expert_slots=48, planned_expert_slots=48, max_expert_slots=64, expert_slot_bytes=8 * MiB,
    )
    sup = FakeSupervisor(pool)
    sup.check_ready = lambda: None  # type: ignore[attr-defined]
    watcher = VramWatcher(sup, None, None, kind="simulated")  # type: ignore[arg-type]
    control = SupervisorControl(sup, watcher)  # type: ignore[arg-type]
    asyncio.run(control.set_expert_cache(100 * MiB))  # 12.5 slots: 12
    kind, fields = sup.link.commands[-1]
    assert kind == "ResizeExpertCache" and fields["num_slots"] == 12 and fields["origin"] == BY_CONTROL
    assert watcher.expert_ceiling_slots == 12
    asyncio.run(control.set_expert_cache(None))  # back to the plan, no ceiling
    assert sup.link.commands[-1][1]["num_slots"] == 48 and watcher.expert_ceiling_slots is None
    asyncio.run(control.set_expert_cache(10 << 30))  # more than every expert: all of them
    assert sup.link.commands[-1][1]["num_slots"] == 64
    sup.link.pool = msgspec.structs.replace(pool, max_expert_slots=0, expert_slot_bytes=0)
    with pytest.raises(NotImplementedError, match="--cpu-experts"):
        asyncio.run(control.set_expert_cache(MiB))
