"""The restart-race guard (a stale worker outlives its killed service) with real processes.

A fake service spawns a worker the way the supervisor does (multiprocessing *spawn*),
records it in the pid file and is killed with SIGKILL: its worker survives it. The next
start's reap finds and ends that worker, and leaves alone every other process the pid
file names: a ``sleep`` renamed ``headroom-worker``, a Python script called
``headroom_worker_lookalike.py``, a pid now used by another program, and the worker of
a service that still runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.memory.plan import GiB
from service.supervision import stale
from service.supervision.release import wait_for_release
from service.supervision.stale import (
    ENDED,
    GONE,
    LEFT_ALONE,
    WorkerRecord,
    default_pidfile,
    forget_worker,
    is_alive,
    is_worker_cmdline,
    read_cmdline,
    read_pidfile,
    reap_stale_workers,
    record_worker,
    start_time,
)
from service.vram.simulated import SimulatedSource
from service.vram.sources import NvmlSource

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

ROOT = Path(__file__).resolve().parents[1]

FAKE_SERVICE = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from pathlib import Path
    from service.supervision.stale import record_worker

    if __name__ == "__main__":
        worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,), daemon=True)
        worker.start()
        record_worker(worker.pid, Path(sys.argv[1]))
        print(worker.pid, flush=True)
        time.sleep(300)
    """
)

LOOKALIKE = "import time\ntime.sleep(300)\n"


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def procs():
    """Processes a test starts; all ended at the end, by their own pid."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def spawn_cmdline() -> list[str]:
    return [
        sys.executable,
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
        "--multiprocessing-fork",
    ]


def test_worker_command_lines():
    assert is_worker_cmdline(spawn_cmdline())
    assert is_worker_cmdline(["/usr/bin/python3.11", "-m", "engine.worker.process"])
    assert not is_worker_cmdline(["headroom-worker", "300"])
    assert not is_worker_cmdline(
        [sys.executable, "headroom_worker_lookalike.py", "--multiprocessing-fork", "spawn_main"]
    )
    assert not is_worker_cmdline(
        [sys.executable, "-c", "from multiprocessing.resource_tracker import main;main(5)"]
    )
    assert not is_worker_cmdline(
        [
            "/bin/sh",
            "-c",
            "from multiprocessing.spawn import spawn_main; spawn_main()",
            "--multiprocessing-fork",
        ]
    )
    assert not is_worker_cmdline([sys.executable, "-m", "engine.worker_lookalike"])
    assert not is_worker_cmdline([])


def test_proc_helpers():
    me = os.getpid()
    assert is_alive(me) and read_cmdline(me)[0] and start_time(me) > 0
    assert not is_alive(2**22 + 12345) and read_cmdline(2**22 + 12345) is None


def test_pidfile_records_and_forgets(tmp_path):
    pidfile = tmp_path / "workers.json"
    assert read_pidfile(pidfile) == []
    rec = record_worker(os.getpid(), pidfile, wait_s=0)
    assert rec.cmdline == tuple(read_cmdline(os.getpid())) and rec.start_time == start_time(
        os.getpid()
    )
    assert rec.service_pid == os.getpid()
    assert read_pidfile(pidfile) == [rec]
    record_worker(os.getpid(), pidfile, wait_s=0)  # recorded once
    assert len(read_pidfile(pidfile)) == 1
    forget_worker(os.getpid(), pidfile)
    assert read_pidfile(pidfile) == []
    pidfile.write_text("{not json")
    assert read_pidfile(pidfile) == []  # a broken file lists nothing


def test_default_pidfile_is_in_the_runtime_dir_else_the_cache_dir(tmp_path, monkeypatch):
    import platformdirs

    monkeypatch.delenv("HEADROOM_RUNTIME_DIR", raising=False)  # the test session sets its own
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))  # platformdirs is faked below
    monkeypatch.setattr(platformdirs, "user_runtime_dir", lambda app: str(tmp_path / "run" / app))
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / "cache" / app))
    assert default_pidfile() == tmp_path / "run" / "headroom" / "workers.json"
    (tmp_path / "blocked").write_text("a file where a folder should be")
    monkeypatch.setattr(
        platformdirs, "user_runtime_dir", lambda app: str(tmp_path / "blocked" / app)
    )
    assert default_pidfile() == tmp_path / "cache" / "headroom" / "workers.json"


def test_a_stale_worker_is_ended_and_lookalikes_are_left_alone(tmp_path, procs):
    pidfile = tmp_path / "workers.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    (tmp_path / "fake_service.py").write_text(FAKE_SERVICE)
    service = subprocess.Popen(
        [sys.executable, str(tmp_path / "fake_service.py"), str(pidfile)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    procs.append(service)
    worker = int(service.stdout.readline())
    assert is_worker_cmdline(read_cmdline(worker))
    # The service dies hard; its worker does not.
    service.send_signal(signal.SIGKILL)
    service.wait(timeout=10)
    time.sleep(0.2)
    assert is_alive(worker), "the fake worker should have survived its service"

    # Unrelated processes with similar names, named in the pid file as if they were
    # workers of the dead service.
    renamed = subprocess.Popen(["headroom-worker", "300"], executable="/bin/sleep")
    (tmp_path / "headroom_worker_lookalike.py").write_text(LOOKALIKE)
    lookalike = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "headroom_worker_lookalike.py"),
            "--multiprocessing-fork",
            "spawn_main",
        ]
    )
    procs.extend([renamed, lookalike])
    assert wait_until(lambda: read_cmdline(renamed.pid) == ["headroom-worker", "300"])
    assert wait_until(lambda: (read_cmdline(lookalike.pid) or [""])[-1] == "spawn_main")
    for p in (renamed, lookalike):
        record_worker(p.pid, pidfile, service_pid=service.pid, wait_s=0)
    # A pid reused: the file says a worker ran there; another program runs there now.
    reused = subprocess.Popen(["sleep", "300"])
    procs.append(reused)
    assert wait_until(lambda: read_cmdline(reused.pid) == ["sleep", "300"])
    records = read_pidfile(pidfile)
    records.append(
        WorkerRecord(reused.pid, None, tuple(spawn_cmdline()), service.pid, None, time.time())
    )
    # A worker whose service (this test) still runs.
    live = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,), daemon=True)
    live.start()
    try:
        assert wait_until(lambda: is_worker_cmdline(read_cmdline(live.pid) or []))
        # And one that is gone.
        records.append(
            WorkerRecord(2**22 + 4321, 1, tuple(spawn_cmdline()), service.pid, None, time.time())
        )
        stale._write(pidfile, records)
        record_worker(live.pid, pidfile)

        results = {r.pid: r for r in reap_stale_workers(pidfile, term_timeout_s=5.0)}

        assert results[worker].outcome == ENDED, results[worker]
        assert wait_until(lambda: not is_alive(worker))
        for p, words in [
            (renamed, "not a headroom worker"),
            (lookalike, "not a headroom worker"),
            (reused, "another command"),
        ]:
            assert results[p.pid].outcome == LEFT_ALONE and words in results[p.pid].reason, results[
                p.pid
            ]
            assert p.poll() is None and is_alive(p.pid), f"{read_cmdline(p.pid)} was touched"
        assert (
            results[live.pid].outcome == LEFT_ALONE and "still running" in results[live.pid].reason
        )
        assert live.is_alive()
        assert results[2**22 + 4321].outcome == GONE
        # Only the live service's worker stays listed.
        assert [r.pid for r in read_pidfile(pidfile)] == [live.pid]
        data = json.loads(pidfile.read_text())
        assert data["version"] == 1 and data["workers"][0]["cmdline"] == read_cmdline(live.pid)
        # A second reap finds nothing more to do.
        again = reap_stale_workers(pidfile)
        assert [(r.pid, r.outcome) for r in again] == [(live.pid, LEFT_ALONE)]
    finally:
        live.terminate()
        live.join(10)


# -- waiting for a dead worker's memory ----------------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_wait_until_nvml_no_longer_lists_the_pid():
    t = FakeTime()
    src = SimulatedSource(
        24 * GiB,
        lambda now: GiB + (2 * GiB if now < 1.5 else 0),
        clock=t.clock,
        processes=lambda now: (
            [(1, "Xorg", GiB)] + ([(4242, "python", 2 * GiB)] if now < 1.5 else [])
        ),
    )
    res = wait_for_release(4242, src, clock=t.clock, sleep=t.sleep)
    assert res.released and 1.5 <= res.waited_s < 1.7 and "no longer shows pid 4242" in res.reason
    assert res.freed_bytes == 2 * GiB


def test_wait_gives_up_after_the_timeout():
    t = FakeTime()
    src = SimulatedSource(
        24 * GiB, [(0, 3 * GiB)], clock=t.clock, processes=lambda now: [(4242, "python", 2 * GiB)]
    )
    res = wait_for_release(4242, src, timeout_s=10, clock=t.clock, sleep=t.sleep)
    assert not res.released and 10 <= res.waited_s < 10.2
    assert res.reason == "after 10 s, pid 4242 still holds 2048 MiB"


def test_wait_without_pid_attribution_watches_the_free_memory():
    """A container: NVML lists no pids. Released once the process is gone and the free
    memory stopped rising (the driver returns a dead process's memory over a moment)."""
    t = FakeTime()
    src = SimulatedSource(24 * GiB, lambda now: 4 * GiB - int(min(now, 2.0) * GiB), clock=t.clock)
    res = wait_for_release(4242, src, clock=t.clock, sleep=t.sleep, alive=lambda pid: t.now < 1.0)
    assert res.released and 2.0 <= res.waited_s < 2.4 and "stopped rising" in res.reason
    assert res.freed_bytes == 2 * GiB


def test_wait_in_cpu_mode_returns_at_once():
    class NoGpu:
        def sample(self):
            return NvmlSource(nvml=_no_nvml()).sample()

    res = wait_for_release(4242, NoGpu())
    assert res.released and res.waited_s == 0.0 and "CPU mode" in res.reason


def _no_nvml():
    class Err(Exception):
        pass

    class M:
        NVMLError = Err

        @staticmethod
        def nvmlInit():
            raise Err("NVML Shared Library Not Found")

    return M


def test_wait_with_the_real_nvml_never_raises():
    res = wait_for_release(2**22 + 99, NvmlSource(), timeout_s=0.5, poll_s=0.05)
    assert res.released or res.waited_s >= 0.5
