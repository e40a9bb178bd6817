"""The VRAM watcher's sources, torch-free: the simulated card and its timeline, NVML
read through a stand-in module (no GPU, a GPU that appears later, a failed read), the
reserve, ``watch``'s sampling and a ``--device-limit`` read as a card of that size.
"""

from __future__ import annotations

import asyncio
import sys
import types

import msgspec
import pytest

from engine.memory.plan import GiB, MiB, reserve_for
from service.vram.simulated import SimulatedSource
from service.vram.sources import (
    REOPEN_INTERVAL_S,
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
