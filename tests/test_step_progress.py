"""A long step is not a stall: the worker's heartbeat thread and its work counter, the
watchdog's rules on a fake clock (a long step that moves on lives; a silent worker and a
stuck step die), and the test-only ``slow`` fault. The same through ``headroom serve``
is in ``test_service_restart.py``."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
from pool_fakes import STATS

from engine.common import faults, progress
from engine.common.faults import ENV_VAR, FaultInjector
from engine.wire.ipc import Heartbeat, Outputs, from_worker_decoder
from engine.wire.messages import TokenOutput
from engine.worker.heartbeat import HeartbeatThread, SharedPipe
from service.supervision.liveness import Liveness

TIMEOUT_S = 10.0


def beat(count: int, *, waiting: bool = False) -> Heartbeat:
    return Heartbeat(stats=STATS, progress=count, waiting=waiting)


# -- the watchdog's rules -------------------------------------------------------------------------


def test_a_long_step_that_moves_on_is_not_a_stall():
    live = Liveness(0.0)
    for second in range(1, 47):  # a 46 s step, its counter advancing every second
        live.heard(beat(second), float(second))
        assert live.stall(second + 0.5, TIMEOUT_S) is None


def test_a_silent_worker_is_killed_after_the_stall_timeout():
    live = Liveness(0.0)
    live.heard(beat(1), 1.0)
    assert live.stall(11.0, TIMEOUT_S) is None
    assert live.stall(11.5, TIMEOUT_S) == "sent no heartbeat for 10.5 s"


def test_a_stuck_step_is_killed_though_its_heartbeats_arrive():
    live = Liveness(0.0)
    live.heard(beat(7), 1.0)
    for t in range(2, 12):  # the heartbeat thread runs on; the counter does not move
        live.heard(beat(7), float(t))
        assert live.stall(float(t), TIMEOUT_S) is None
    assert live.stall(11.5, TIMEOUT_S) == (
        "made no progress for 10.5 s though its heartbeats arrive (a stuck step)"
    )
    # Once it moves again it is alive again.
    live.heard(beat(8), 11.6)
    assert live.stall(11.6, TIMEOUT_S) is None


def test_an_idle_worker_and_outputs_count_as_moving_on():
    live = Liveness(0.0)
    for t in range(1, 40):  # waiting for work: nothing to progress on
        live.heard(beat(3, waiting=True), float(t))
    assert live.stall(40.0, TIMEOUT_S) is None
    live.heard(beat(3), 41.0)
    live.heard(Outputs([TokenOutput(request_id="a", token_ids=[1])]), 50.0)
    for t in range(51, 60):
        live.heard(beat(3), float(t))
    assert live.stall(59.0, TIMEOUT_S) is None
    assert "made no progress for 10.5 s" in live.stall(60.5, TIMEOUT_S)
    live.reset(61.0)  # a new worker, or one just ready
    assert live.stall(70.0, TIMEOUT_S) is None and live.progress is None


# -- the heartbeat thread ---------------------------------------------------------------------------


def test_heartbeats_come_from_a_thread_while_the_main_one_works_and_sends():
    """The main thread sends outputs and advances the counter as the heartbeat thread
    beats on the same pipe: every frame decodes (no two interleave) and the beats carry
    a counter that only grows."""
    ours, theirs = multiprocessing.Pipe()
    pipe = SharedPipe(theirs)
    beats = HeartbeatThread(pipe, 0.001, STATS, None)
    received: list = []

    def read() -> None:
        while True:
            message = from_worker_decoder.decode(ours.recv_bytes())
            received.append(message)
            if isinstance(message, Outputs) and message.outputs[0].request_id == "last":
                return

    reader = threading.Thread(target=read)
    reader.start()
    beats.start()
    deadline = time.monotonic() + 60
    sent = 0
    while sum(isinstance(m, Heartbeat) for m in received) < 20 and time.monotonic() < deadline:
        progress.advance()
        pipe.send(Outputs([TokenOutput(request_id=f"r{sent}", token_ids=list(range(500)))]))
        sent += 1
    beats.stop()
    pipe.send(Outputs([TokenOutput(request_id="last", token_ids=[])]))
    reader.join(timeout=60)
    counts = [m.progress for m in received if isinstance(m, Heartbeat)]
    assert len(counts) >= 20
    assert counts == sorted(counts) and counts[-1] > counts[0]
    outputs = [m.outputs[0].request_id for m in received if isinstance(m, Outputs)]
    assert outputs == [f"r{i}" for i in range(sent)] + ["last"]


# -- the slow fault ---------------------------------------------------------------------------------


def test_slow_rules_parse_as_the_other_sites_do_with_seconds_last():
    inj = FaultInjector.parse("slow:*:1:25, slow:a:b:2:0.5,prefill:x")
    assert [(r.site, r.request_id, r.remaining, r.seconds) for r in inj.rules] == [
        ("slow", "*", 1, 25.0),
        ("slow", "a:b", 2, 0.5),
        ("prefill", "x", 1, 0.0),
    ]
    for bad in ("slow", "slow:*:25", "slow:*:1", "slow:*:1:0", "slow:*:1:soon", "slow:*:x:5"):
        with pytest.raises(ValueError, match="expected slow:request:times:seconds") as err:
            FaultInjector.parse(bad)
        assert ENV_VAR in str(err.value)
    with pytest.raises(ValueError, match="times must be >= 1"):
        FaultInjector.parse("slow:*:0:5")
    with pytest.raises(ValueError, match="seconds > 0 go with the 'slow' site only"):
        FaultInjector().add("decode", "*", seconds=2.0)


def test_a_slow_step_takes_its_seconds_advancing_the_counter(monkeypatch):
    clock = [100.0]

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

        @staticmethod
        def sleep(s: float) -> None:
            clock[0] += s

    monkeypatch.setattr(faults, "time", FakeTime)
    inj = FaultInjector()
    inj.add("slow", "b", times=1, seconds=25.0)
    before = progress.read()
    inj.check("slow", ["a"])  # not the target: no time taken
    assert clock[0] == 100.0
    inj.check("slow", ["a", "b"])  # returns: a slow step, not an error
    assert clock[0] == pytest.approx(125.0)
    assert progress.read() - before == pytest.approx(25.0 / faults.SLOW_SLICE_S, abs=1)
    inj.check("slow", ["b"])  # used up
    assert clock[0] == pytest.approx(125.0)
    assert inj.fired == [("slow", "b")] and inj.pending == 0
