"""The CPU thread count fitted to the cores other programs leave free
(engine/worker/cpu_threads.py): the rule on scripted loads, /proc/stat read for real, and a
real busy process beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from service_harness import wait_for

from engine.worker.cpu_threads import CpuThreads, read_proc_stat


class Machine:
    """A scripted machine of ``n`` cores: each :meth:`tick` is one second in which other
    programs keep ``elsewhere`` cores busy and the engine ``own`` cores."""

    def __init__(self, n: int) -> None:
        self.n, self.now, self.busy, self.total, self.own = n, 0.0, 0, 0, 0.0

    def tick(self, elsewhere: float, own: float = 0.5) -> None:
        self.now += 1.0
        self.busy += int((elsewhere + own) * 100)
        self.total += self.n * 100
        self.own += own

    def threads(self, **kw) -> CpuThreads:
        return CpuThreads(cores=frozenset(range(self.n)), read_stat=lambda cpus: (self.busy, self.total),
                          own_seconds=lambda: self.own, clock=lambda: self.now, clock_ticks=100, **kw)


def run(machine: Machine, fit: CpuThreads, loads: list[float]) -> list[int]:
    fit.update()  # the first reading only starts the window
    seen = []
    for elsewhere in loads:
        machine.tick(elsewhere)
        fit.update()
        seen.append(fit.current)
    return seen


def test_a_busy_core_elsewhere_drops_a_thread_at_once_and_it_comes_back_slowly():
    m = Machine(2)
    fit = m.threads()
    assert fit.current == 2
    # Idle, then a game takes a core, then leaves: the drop is immediate, the rise waits
    # for three quiet seconds in a row.
    assert run(m, fit, [0.0, 0.1, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]) == [2, 2, 1, 1, 1, 1, 2, 2]


def test_a_burst_elsewhere_does_not_flap_the_count():
    m = Machine(8)
    fit = m.threads()
    assert run(m, fit, [3.0, 0.0, 3.0, 0.0, 0.0, 0.0]) == [5, 5, 5, 5, 5, 8]


def test_at_least_one_thread_and_a_fixed_count_never_moves():
    m = Machine(4)
    assert run(m, m.threads(), [9.0]) == [1]
    assert run(m, m.threads(fixed=3), [9.0, 0.0, 0.0, 0.0, 0.0]) == [3] * 5


def test_proc_stat_is_read_per_cpu(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\n"
                    "cpu0 4 0 6 50 5 0 0 0 0 0\n"
                    "cpu1 6 0 4 50 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    assert read_proc_stat(frozenset({0}), str(stat)) == (10, 65)
    assert read_proc_stat(frozenset({0, 1}), str(stat)) == (20, 125)
    assert read_proc_stat(frozenset({0}), str(tmp_path / "missing")) is None


@pytest.mark.skipif(read_proc_stat(frozenset({0})) is None, reason="no /proc/stat here")
def test_a_real_busy_process_takes_a_thread_away():
    fit = CpuThreads(interval_s=0.5)
    if len(fit.cores) < 2:
        pytest.skip("one usable core: nothing to take away")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        def dropped() -> bool:
            fit.update()
            time.sleep(0.1)  # the window is measured between calls
            return fit.current <= len(fit.cores) - 1

        wait_for(dropped, 60, "the thread count to leave the busy core")
    finally:
        hog.kill()
        hog.wait()


def test_the_option_takes_auto_or_a_count_from_every_source(tmp_path):
    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

    config = tmp_path / "config.toml"
    config.write_text("cpu_threads = 1\n")
    assert resolve({}, env={}, config_path=config).cpu_threads == "1"
    assert resolve({}, env={"HEADROOM_CPU_THREADS": "auto"}, config_path=config).cpu_threads == "auto"
    for bad in ("0", "-1", "many"):
        with pytest.raises(SettingsError, match="--cpu-threads: .* is not auto or a number of threads"):
            resolve({"cpu_threads": bad}, env={}, config_path=config)
    # More threads than cores: each op waits for time slices, and hundreds of threads
    # stall a step past the watchdog.
    cores = len(os.sched_getaffinity(0))
    assert resolve({"cpu_threads": str(cores)}, env={}, config_path=config).cpu_threads == str(cores)
    with pytest.raises(SettingsError, match=f"--cpu-threads: {cores + 1} is more than the {cores} cores .* 1-{cores}"):
        resolve({"cpu_threads": str(cores + 1)}, env={}, config_path=config)
