"""The VRAM watcher against a simulated card and a fake worker link, without a server:
it turns a timeline into replan commands (the prefill chunk, the GPU expert cache, the
KV pool), leaves a CPU engine alone, and the control API sizes the expert cache in
whole slots; the timeline file it plays.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from pool_fakes import STATS, pool_stats
from service_harness import engine_info as info

from engine.common.units import GiB, MiB
from engine.wire import ipc
from engine.wire.messages import BY_CONTROL, BY_WATCHER
from service.common.engine_states import State
from service.vram.simulated import (
    SimulatedSource,
    TimelineError,
    file_triggered,
    load_timeline,
    simulated_ours_bytes,
)
from service.vram.watcher import VramWatcher


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
        self.kept_kv_pool: tuple[int | None, str] | None = None

    def keep_kv_pool(self, pages: int | None, what: str = "") -> None:
        """Records the pool a live change kept for the next worker (the supervisor's
        :meth:`~service.supervision.unloading.Unloading.keep_kv_pool`)."""
        self.kept_kv_pool = (pages, what)


def play_timeline(pool: ipc.PoolStats, rise: int, read: Callable[[ipc.PoolStats], int]):
    """Run a :class:`VramWatcher` (1 s hold) for 10 s, a step every 0.25 s, over the worker
    ``pool`` on a simulated 4 GiB card with no reserve (no display), so the plan left about
    the safety margin free: the others take 200 MiB less than that margin, ``rise`` bytes
    more than it from 2 s to 6 s, then 200 MiB less again. Returns the supervisor, the
    watcher and ``read(pool)`` after every step."""
    sup = FakeSupervisor(pool)
    now = [0.0]
    total = 4 * GiB
    margin = total - simulated_ours_bytes(pool)
    source = SimulatedSource(
        total,
        [(0.0, margin - 200 * MiB), (2.0, margin + rise), (6.0, margin - 200 * MiB)],
        ours_bytes=lambda: simulated_ours_bytes(sup.link.pool),
        clock=lambda: now[0],
    )
    watcher = VramWatcher(sup, None, source, kind="simulated", hold_s=1.0)  # type: ignore[arg-type]

    async def play() -> list[int]:
        seen = []
        while now[0] < 10.0:
            await watcher.step(source.sample())
            assert sup.link.pool is not None
            seen.append(read(sup.link.pool))
            now[0] += 0.25
        return seen

    return sup, watcher, asyncio.run(play())


def test_the_watcher_follows_a_simulated_timeline_with_commands():
    pool = pool_stats(
        2001, min_pages=129, activation_bytes_per_token=16 << 10, max_context_tokens=2048
    )
    sup, watcher, pages = play_timeline(pool, 1000 * MiB, lambda p: p.pages)
    kinds = [k for k, _ in sup.link.commands]
    assert kinds[0] == "SetPrefillChunk" and "ResizePool" in kinds
    assert min(pages) < 2001 and pages[-1] == 2001  # shrank, then grew back to the plan
    assert sup.link.pool is not None and sup.link.pool.prefill_chunk == 2048
    assert kinds.count("ResizePool") <= 5
    # A ceiling asked for through the control API caps the grow.
    watcher.kv_ceiling_pages = 1500
    assert watcher.pool_state(sup.link.pool).planned_pages == 1500


def test_the_watcher_leaves_a_cpu_engine_alone_on_a_real_gpu():
    # A CPU engine has no plan: nothing besides the pool.
    pool = pool_stats(200, min_pages=10, activation_bytes_per_token=0, max_context_tokens=2048)
    sup = FakeSupervisor(msgspec.structs.replace(pool, fixed_bytes=0))
    sup.info = info(device="cpu")
    full = SimulatedSource(GiB, [(0.0, GiB)], clock=lambda: 0.0)  # nothing free at all
    watcher = VramWatcher(sup, None, full, kind="nvml")  # type: ignore[arg-type]
    assert asyncio.run(watcher.step(full.sample())) == []
    assert sup.link.commands == []


# -- the timeline file ---------------------------------------------------------------------------


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
                '{"baseline": "gone"}', '{"steps": [[0, 0]], "bogus": 1}', '{"steps": [[-5, 0]]}',
                '{"steps": [[5, 0], [1, "1GiB"]]}'):
        path.write_text(bad)
        with pytest.raises(TimelineError, match=str(path.name)):
            load_timeline(path)
    with pytest.raises(TimelineError, match="cannot read"):
        load_timeline(tmp_path / "missing.json")


def test_serve_refuses_a_bad_timeline_before_the_port_opens(tmp_path):
    """A timeline the watcher could not play is a usage error at once (exit 2, one line
    naming the file and the step), not a start that fails after the port is bound."""
    import os

    from click.testing import CliRunner

    from service.cli.commands import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"steps": [[0, 0], [9, "1GiB"], [3, 0]]}))
    args = ["serve", "--vram-source", "simulated", "--device-total", "2GiB", "--vram-timeline", str(path)]
    result = CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull})
    assert result.exit_code == 2, result.output
    assert f"{path}: step 2 starts at 3 s: steps are in order of time" in result.stderr


def test_a_timeline_step_can_wait_for_a_file(tmp_path):
    """A step of ``"file:PATH"`` begins at the first sample that finds PATH, once the
    steps before it began; a step of seconds after it never comes before it."""
    leave = tmp_path / "leave"
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"steps": [[0, 0], [1, "700MiB"], [f"file:{leave}", "100MiB"], [5, 0]]}))
    steps = load_timeline(path, default_total=4 * GiB).steps
    assert steps == ((0.0, 0), (1.0, 700 * MiB), (f"file:{leave}", 100 * MiB), (5.0, 0))
    others = file_triggered(steps)
    assert [others(t) for t in (-1.0, 0.5, 2.0, 9.0)] == [0, 0, 700 * MiB, 700 * MiB]  # no file yet
    leave.write_text("")
    assert others(10.0) == 0  # found at t=10: its step began, and the 5 s step after it too
    others = file_triggered(steps)
    assert others(0.5) == 0  # the file exists, but the 1 s step before it has not begun
    assert others(3.0) == 100 * MiB and others(4.0) == 100 * MiB and others(5.0) == 0
    source = SimulatedSource(4 * GiB, file_triggered(steps[:3]))
    assert source.sample(at=1.5).others_bytes == 100 * MiB
    for bad in ([["file:", 0]], [["later", 0]], [[True, 0]]):
        path.write_text(json.dumps({"steps": bad}))
        with pytest.raises(TimelineError, match=r'\["file:PATH", size\]'):
            load_timeline(path, default_total=GiB)


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
    sup, watcher, slots = play_timeline(pool, 50 * MiB, lambda p: p.expert_slots)
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
    sup.link.pool = msgspec.structs.replace(pool, max_expert_slots=0, expert_slot_bytes=0, moe_layers=4)
    with pytest.raises(NotImplementedError, match="--cpu-experts"):  # a MoE model, every expert on the device
        asyncio.run(control.set_expert_cache(MiB))


# -- grows judged within one sample --------------------------------------------------------------


def _one_sample_card(free: int):
    """A worker's pool of 1,001 pages of 1 MiB whose plan gave 4,001, on a simulated
    4 GiB card with no reserve (no display) that has ``free`` bytes free; the clock
    stands still, so every sample is read at the same instant."""
    pool = msgspec.structs.replace(
        pool_stats(1001, min_pages=129, activation_bytes_per_token=0, max_context_tokens=2048), planned_pages=4001
    )
    sup = FakeSupervisor(pool)
    sup.check_ready = lambda: None  # type: ignore[attr-defined]
    others = 4 * GiB - simulated_ours_bytes(pool) - free
    source = SimulatedSource(4 * GiB, [(0.0, others)], ours_bytes=lambda: simulated_ours_bytes(sup.link.pool),
                             clock=lambda: 0.0)
    watcher = VramWatcher(sup, None, source, kind="simulated", hold_s=0.0)  # type: ignore[arg-type]
    return sup, source, watcher


def test_two_grows_decided_on_one_sample_take_its_free_memory_once():
    """Two decisions on the same sample (no hold): the second sees the pages the first
    took, so together they leave the grow floor free, as the next sample shows."""
    sup, source, watcher = _one_sample_card(GiB)
    sample = source.sample()
    asyncio.run(watcher.step(sample))
    first = sup.link.pool.pages
    assert first > 1001  # it grew toward the plan
    asyncio.run(watcher.step(sample))
    floor = watcher.controller.grow_floor_bytes
    assert (sup.link.pool.pages - 1001) * MiB <= GiB - floor, sup.link.commands
    after = source.sample()
    assert after.free_bytes >= floor
    assert watcher.expected(sample).free_bytes == after.free_bytes  # what was expected is what the card shows
    asyncio.run(watcher.step(after))  # the next sample shows the grow: nothing is counted twice
    assert watcher.expected(after).free_bytes == after.free_bytes


def test_control_grows_within_one_sample_are_judged_on_what_is_left():
    """Two KV grows asked for through the control API before the next sample: the second
    is judged on the room the first left (409 ``no_room``), and so is the watcher's."""
    from service.common.errors import APIError
    from service.control.actions import SupervisorControl

    sup, source, watcher = _one_sample_card(GiB)
    watcher.latest = source.sample()
    control = SupervisorControl(sup, watcher)  # type: ignore[arg-type]
    asyncio.run(control.set_kv_cache(1500 * MiB))  # 500 pages more of the ~900 MiB room
    assert sup.link.pool.pages == 1501
    with pytest.raises(APIError) as refused:
        asyncio.run(control.set_kv_cache(2000 * MiB))  # 500 more: only ~400 MiB are left
    assert refused.value.status == 409 and refused.value.code == "no_room"
    assert sup.link.pool.pages == 1501
    watcher.kv_ceiling_pages = None  # the watcher may grow to the plan: within what is left
    asyncio.run(watcher.step(watcher.latest))
    assert source.sample().free_bytes >= watcher.controller.grow_floor_bytes
