"""The supervisor's waits without a worker (:mod:`service.supervision.waits`) on a
simulated card: which misfits are worth waiting for, the wait for memory with its settle
time, the worker errors that mean "wait for the GPU", the backoff, a GPU that appears,
and ``--keep-alive`` durations."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.common.faults import FaultInjector, check_cuda_init
from engine.wire.ipc import Misfit, WorkerError
from service.common.settings import SettingsError, parse_duration
from service.common.settings_sources import resolve
from service.supervision import waits
from service.vram.simulated import SimulatedSource, load_timeline

GiB = 1 << 30


def _misfit(others: int, shortfall: int, simulated: bool = True) -> WorkerError:
    misfit = Misfit(total_bytes=8 * GiB, others_bytes=others, shortfall_bytes=shortfall, simulated=simulated)
    return WorkerError(message="does not fit", kind="PlanDoesNotFit", during_load=True, misfit=misfit)


def test_only_a_misfit_the_other_processes_cause_is_waited_for():
    card = SimulatedSource(8 * GiB)
    waitable = waits.misfit_to_wait_for(_misfit(6 * GiB, 2 * GiB), card)
    assert waitable is not None
    # Free 2 GiB now (8 - 6), 2 GiB short: 4 GiB must be free.
    assert waitable.needed_free_bytes == 4 * GiB
    # Larger than the card: no wait fixes it.
    assert waits.misfit_to_wait_for(_misfit(1 * GiB, 3 * GiB), card) is None
    assert waits.misfit_to_wait_for(_misfit(0, 1), card) is None
    # Planned on a simulated card, watched on a real one: its numbers never move.
    class RealCard(SimulatedSource):
        simulated = False

    assert waits.misfit_to_wait_for(_misfit(6 * GiB, 2 * GiB), RealCard(8 * GiB)) is None
    assert waits.misfit_to_wait_for(_misfit(6 * GiB, 2 * GiB), None) is None


def _wait_out(card: SimulatedSource, wait: waits.MemoryWait, now: dict, on_change=None):
    """Run ``wait_for_memory`` (settle 1 s) while the card's clock ``now["t"]`` moves 0.05
    simulated seconds each 10 ms; its last sample."""
    async def run():
        async def tick():
            while True:
                await asyncio.sleep(0.01)
                now["t"] += 0.05

        ticker = asyncio.create_task(tick())
        try:
            return await asyncio.wait_for(waits.wait_for_memory(card, wait, 1.0, period_s=0.01, on_change=on_change), 60)
        finally:
            ticker.cancel()

    return asyncio.run(run())


def test_the_wait_ends_once_the_memory_stayed_free_for_the_settle_time():
    now = {"t": 0.0}
    # Another app holds 6 GiB, drops to 5 GiB (not enough), then leaves.
    card = SimulatedSource(8 * GiB, [(0, 6 * GiB), (1, 5 * GiB), (2, 0)], clock=lambda: now["t"])
    wait = waits.MemoryWait(_misfit(6 * GiB, 2 * GiB).misfit, "does not fit")
    changes: list[int] = []
    sample = _wait_out(card, wait, now, on_change=lambda: changes.append(wait.free_bytes))
    assert sample.free_bytes == 8 * GiB
    # Settled: at least a second of simulated time after the app left at t=2.
    assert sample.timestamp >= 3.0
    assert changes[:3] == [2 * GiB, 3 * GiB, 8 * GiB]
    report = wait.report()
    assert report["short_bytes"] == 0 and report["needed_bytes"] == 4 * GiB
    assert not wait.free_at_once  # another app really held it


def test_memory_free_at_once_was_the_worker_s_own_and_is_not_waited_for_again():
    """Inside a container NVML names no process, so the worker counts its own CUDA context
    as other processes' memory: its misfit looks waitable, the wait ends at its first
    sample (the worker has exited, its memory is back), and the next worker fails the
    same way. On a real card the second misfit is refused, not waited for forever."""
    now = {"t": 0.0}
    card = SimulatedSource(8 * GiB, clock=lambda: now["t"])
    card.simulated = False  # a real card's NVML, as the service reads it
    real = _misfit(1 * GiB, 512 << 20, simulated=False)
    wait = waits.MemoryWait(real.misfit, "does not fit")
    _wait_out(card, wait, now)
    assert wait.free_at_once
    assert waits.misfit_to_wait_for(real, card) is not None  # the first time: waited for
    assert waits.misfit_to_wait_for(real, card, last=wait) is None  # again after it: refused
    assert "the worker's own" in waits.OWN_MEMORY
    # A simulated card's next worker plans on the memory the wait saw: no loop to stop.
    simulated = _misfit(1 * GiB, 512 << 20)
    assert waits.misfit_to_wait_for(simulated, SimulatedSource(8 * GiB), last=wait) is not None


@pytest.mark.parametrize(
    ("kind", "message", "wait"),
    [
        ("CudaUnavailable", "CUDA failed to initialise", True),
        ("TorchWithoutCuda", "--device cuda asks for a GPU but the installed torch 2.13.0+cpu is built without CUDA", False),
        ("AcceleratorError", "CUDA error: an illegal memory access was encountered", True),
        ("RuntimeError", "CUDA error: unknown error", True),
        ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("RuntimeError", "CUDA error: out of memory", False),
        ("ModelLoadError", "no such model", False),
    ],
)
def test_which_worker_errors_wait_for_the_gpu(kind, message, wait):
    assert waits.cuda_fault(WorkerError(message=message, kind=kind, during_load=False)) is wait


def test_gpu_retries_back_off_to_a_cap_and_start_over_once_ready():
    backoff = waits.GpuBackoff(1.0, 8.0)
    assert [backoff.next_delay_s() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    backoff.clear()
    assert backoff.next_delay_s() == 1.0


def test_a_gpu_that_appears_ends_the_backoff_sleep_early(tmp_path):
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"total": "8GiB", "gpu_at": 0.5, "steps": []}))
    parsed = load_timeline(timeline)
    assert parsed.gpu_at == 0.5
    card = SimulatedSource(8 * GiB, gpu_from=parsed.gpu_at)
    assert not card.sample(at=0.1).gpu and "no GPU yet" in card.sample(at=0.1).reason
    assert card.sample(at=0.6).gpu
    # A 10-minute backoff, cut short when the GPU shows up.
    asyncio.run(asyncio.wait_for(waits.sleep_or_gpu_appears(card, 600.0, period_s=0.02), 60))


def test_the_cuda_init_fault_counts_across_engine_starts(tmp_path):
    (tmp_path / "gpu.fault").write_text("cuda_init:*:2")
    env = {"HEADROOM_FAULTS_DIR": str(tmp_path)}
    from engine.common.errors import CudaUnavailable

    for _ in range(2):
        with pytest.raises(CudaUnavailable, match="nvidia_uvm"):
            check_cuda_init(env)
    check_cuda_init(env)  # used up: CUDA starts
    assert (tmp_path / "gpu.fired").exists()
    # A step injector leaves such files to the engine's start.
    (tmp_path / "other.fault").write_text("cuda_init:*:1")
    injector = FaultInjector(spool=tmp_path)
    injector.poll_spool()
    assert injector.rules == [] and (tmp_path / "other.fault").exists()


def test_keep_alive_takes_ollama_durations(tmp_path):
    assert parse_duration("5m") == 300.0
    assert parse_duration("30s") == 30.0
    assert parse_duration("1.5h") == 5400.0
    assert parse_duration("250ms") == 0.25
    assert parse_duration("90") == 90.0
    config = tmp_path / "config.toml"
    config.touch()
    env = {"HEADROOM_CONFIG": str(config)}
    assert resolve({"keep_alive": "5m"}, env=env).keep_alive_s == 300.0
    assert resolve({"keep_alive": "-1"}, env=env).keep_alive_s is None  # Ollama's "forever"
    assert resolve({}, env=env).keep_alive_s is None
    with pytest.raises(SettingsError, match="keep-alive.*not a duration"):
        resolve({"keep_alive": "soon"}, env=env)
