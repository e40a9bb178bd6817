"""The VRAM watcher of a tensor-parallel worker: one source per rank's GPU, the replan
decided on the tightest GPU (which sizes the group's KV pool), every GPU in the events.
Simulated cards on the CPU; ``tests/test_service_tp.py`` runs the same through
``headroom serve --tensor-parallel-size 2``."""

from __future__ import annotations

import asyncio
import json

import pytest
from pool_fakes import pool_stats
from test_vram_watcher import FakeSupervisor

from engine.common.units import GiB, MiB
from service.common.settings_sources import resolve
from service.events.hub import VramThrottle
from service.vram.gpus import GpuGroup, tightest
from service.vram.simulated import (
    SimulatedSource,
    TimelineError,
    load_timeline,
    simulated_ours_bytes,
)
from service.vram.sources import cpu_mode_sample
from service.vram.watcher import VramWatcher, make_watcher

TOTAL = 4 * GiB


def _cards(sup: FakeSupervisor, now: list[float], gpu1_steps) -> list[SimulatedSource]:
    """Two cards of 4 GiB holding the worker's plan; GPU 0's other processes leave the
    plan's margin alone, GPU 1's follow ``gpu1_steps`` (offsets from that margin)."""
    margin = TOTAL - simulated_ours_bytes(sup.link.pool)
    ours = lambda: simulated_ours_bytes(sup.link.pool)  # noqa: E731
    quiet = [(0.0, margin - 200 * MiB)]
    busy = [(t, margin + extra) for t, extra in gpu1_steps]
    return [
        SimulatedSource(TOTAL, steps, ours_bytes=ours, clock=lambda: now[0], name=f"simulated GPU {rank}")
        for rank, steps in enumerate((quiet, busy))
    ]


def _play(watcher: VramWatcher, source, now: list[float], until: float) -> list[int]:
    async def play() -> list[int]:
        pages = []
        while now[0] < until:
            await watcher.step(source.sample())
            pages.append(watcher.supervisor.link.pool.pages)
            now[0] += 0.25
        return pages

    return asyncio.run(play())


def _worker() -> FakeSupervisor:
    return FakeSupervisor(pool_stats(2001, min_pages=129, activation_bytes_per_token=16 << 10,
                                     max_context_tokens=2048))


def test_gpu1_filling_up_shrinks_the_group_while_gpu0_is_free():
    """GPU 1's other processes take 1 GiB past the plan's margin at t=2 and leave at
    t=6; GPU 0 stays free. The group's pool shrinks (one command to rank 0, which
    resizes every rank alike) and grows back; GPU 0 alone would have moved nothing."""
    sup, now = _worker(), [0.0]
    cards = _cards(sup, now, [(0.0, -200 * MiB), (2.0, GiB), (6.0, -200 * MiB)])
    group = GpuGroup(cards)
    watcher = VramWatcher(sup, None, group, kind="simulated", hold_s=1.0)  # type: ignore[arg-type]
    group.reserve_of = watcher.reserve_bytes
    pages = _play(watcher, group, now, 10.0)
    assert min(pages) < 2001 and pages[-1] == 2001
    assert "ResizePool" in [k for k, _ in sup.link.commands]

    alone, now[0] = _worker(), 0.0
    gpu0 = _cards(alone, now, [(0.0, GiB)])[0]
    quiet = VramWatcher(alone, None, gpu0, kind="simulated", hold_s=1.0)  # type: ignore[arg-type]
    assert set(_play(quiet, gpu0, now, 10.0)) == {2001} and alone.link.commands == []


def test_the_event_shows_every_gpu_and_the_tightest_on_top():
    sup, now = _worker(), [3.0]
    group = GpuGroup(_cards(sup, now, [(0.0, GiB)]))
    watcher = VramWatcher(sup, None, group, kind="simulated")  # type: ignore[arg-type]
    group.reserve_of = watcher.reserve_bytes
    sample = group.sample()
    event = watcher.event(sample)
    assert [g.rank for g in event.gpus] == [0, 1]
    assert [g.device for g in event.gpus] == ["simulated GPU 0", "simulated GPU 1"]
    assert event.device == "simulated GPU 1"  # the tightest: GPU 1 is full
    assert event.headroom_bytes == min(g.headroom_bytes for g in event.gpus) < event.gpus[0].headroom_bytes
    assert event.gpus[1].free_bytes == event.free_bytes
    # One GPU: its own sample is the one entry.
    single = VramWatcher(sup, None, group.sources[0], kind="simulated").event(group.sources[0].sample())  # type: ignore[arg-type]
    assert [g.device for g in single.gpus] == ["simulated GPU 0"]


def test_tightest_skips_a_gpu_that_cannot_be_read():
    full = SimulatedSource(GiB, [(0, GiB)]).sample(at=0)
    free = SimulatedSource(GiB).sample(at=0)
    lost = cpu_mode_sample("NVML failed to read GPU 1", 0.0)
    assert tightest([free, full], lambda s: 0) is full
    assert tightest([free, lost], lambda s: 0) is free
    assert tightest([lost, lost], lambda s: 0) is lost
    with pytest.raises(ValueError):
        tightest([], lambda s: 0)


def test_a_change_on_one_gpu_alone_goes_out():
    sup, now = _worker(), [0.0]
    group = GpuGroup(_cards(sup, now, [(0.0, -200 * MiB), (1.0, GiB), (2.0, GiB + 10 * MiB)]))
    watcher = VramWatcher(sup, None, group, kind="simulated")  # type: ignore[arg-type]
    throttle = VramThrottle()
    throttle.last = watcher.event(group.sample())
    now[0] = 1.0
    moved = watcher.event(group.sample())
    assert throttle.significant(moved)
    throttle.last, now[0] = moved, 2.0
    assert not throttle.significant(watcher.event(group.sample()))


def test_timeline_steps_per_gpu(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"total": "4GiB", "steps": [[0, 0]], "gpus": {"1": [[0, 0], [3, "25%"]]}}))
    timeline = load_timeline(path)
    assert timeline.steps == ((0.0, 0),) and timeline.gpus == {1: ((0.0, 0), (3.0, GiB))}
    for bad, message in (({"gpus": {"one": []}}, "by rank"), ({"gpus": [[0, 0]]}, "map a rank"),
                         ({"gpus": {"1": [[0]]}}, "GPU 1's step 0 is not")):
        path.write_text(json.dumps(bad))
        with pytest.raises(TimelineError, match=message):
            load_timeline(path)


def test_a_timeline_started_by_a_file_holds_its_baseline_until_the_file_appears(tmp_path):
    """``"start": "file:PATH"``: the other processes hold what --device-free left out
    (baseline "replaced") until the first sample that finds PATH; the steps play from
    then. A "file:" with no path is refused."""
    config, timeline, leave = tmp_path / "c.toml", tmp_path / "t.json", tmp_path / "leave"
    config.touch()
    timeline.write_text(json.dumps({"start": f"file:{leave}", "baseline": "replaced", "steps": [[0, 0]]}))
    flags = {"vram_source": "simulated", "device_total": "4GiB", "device_free": "1GiB", "device": "cpu",
             "vram_timeline": str(timeline)}
    sup = _worker()
    sup.on_first_ready = None
    source = make_watcher(resolve(flags, env={}, config_path=config), sup, None).source  # type: ignore[arg-type]
    held = [source.sample() for _ in range(3)]  # 3 GiB, as much of it as the worker leaves
    assert all(h.others_bytes == min(3 * GiB, h.total_bytes - h.ours_bytes) > 0 for h in held)
    leave.touch()
    assert source.sample().others_bytes == 0
    timeline.write_text(json.dumps({"start": "file:", "steps": [[0, 0]]}))
    with pytest.raises(TimelineError, match='"ready", "service" or "file:PATH"'):
        load_timeline(timeline)


def test_make_watcher_watches_one_simulated_card_per_rank(tmp_path):
    config = tmp_path / "c.toml"
    config.touch()
    timeline = tmp_path / "t.json"
    timeline.write_text(json.dumps({"gpus": {"1": [[0, "1GiB"]]}}))
    flags = {"vram_source": "simulated", "device_total": "4GiB", "device": "cpu", "tensor_parallel_size": 2,
             "vram_timeline": str(timeline)}
    sup = _worker()
    sup.on_first_ready = None
    watcher = make_watcher(resolve(flags, env={}, config_path=config), sup, None)  # type: ignore[arg-type]
    assert isinstance(watcher.source, GpuGroup) and len(watcher.source.sources) == 2
    timeline.write_text(json.dumps({"gpus": {"2": [[0, "1GiB"]]}}))
    with pytest.raises(TimelineError, match="steps for GPU 2, but the worker runs on 2 GPU"):
        make_watcher(resolve(flags, env={}, config_path=config), sup, None)  # type: ignore[arg-type]
    # Ranks on the CPU without a simulated card leave the GPUs to one NVML source.
    cpu = resolve({"device": "cpu", "tensor_parallel_size": 2}, env={}, config_path=config)
    assert not isinstance(make_watcher(cpu, sup, None).source, GpuGroup)  # type: ignore[arg-type]


def test_a_dead_ranks_memory_is_waited_for_on_its_own_gpu():
    """The restart's release wait asks the group sample for each rank's pid: rank 1's
    memory is on GPU 1 only, and the group's sample finds it there."""
    from service.supervision.release import wait_for_release

    held = {"rank1": GiB}

    def gpu(rank: int):
        def procs(t: float):
            return [(200 + rank, "headroom-rank1", held["rank1"])] if rank == 1 and held["rank1"] else []
        return SimulatedSource(TOTAL, processes=procs, clock=lambda: 0.0, name=f"simulated GPU {rank}")

    group = GpuGroup([gpu(0), gpu(1)])
    assert group.sample().held_by(201) == GiB and group.sample().held_by(999) is None
    clock = [0.0]

    def sleep(s: float) -> None:
        clock[0] += s
        if clock[0] >= 1.0:
            held["rank1"] = 0  # the driver tore rank 1's context down

    result = wait_for_release(201, group, clock=lambda: clock[0], sleep=sleep)
    assert result.released and result.waited_s >= 1.0 and "201" in result.reason
