"""Fast checks of the wiring between the engine worker and the supervisor, without a
server: the replan commands and their answers cross the pipe, the worker carries them
out and answers after the events, and the pool it reports takes its page bytes from the
plan. Engine events turned into hub events are checked in ``test_replan_events.py``, the
VRAM watcher in ``test_vram_watcher.py``, the VRAM settings and ``headroom token`` in
``test_vram_settings.py``.
"""

from __future__ import annotations

from typing import Any

from pool_fakes import STATS, pool_stats
from service_harness import memory_plan

from engine.common.units import GiB, MiB
from engine.memory.plan import LedgerEntry
from engine.wire import ipc
from engine.wire.messages import (
    BY_CONTROL,
    BY_WATCHER,
    REPLAN_RESIZE_POOL,
    EngineStats,
    Replanned,
    ReplanWanted,
    ResizeResult,
)
from service.vram.simulated import simulated_ours_bytes

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
        self.pool = type("Pool", (), {"num_pages": 101, "nbytes": 101 * MiB, "page_bytes": MiB})()
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
                before_kv_pool_bytes=(before - 1) * MiB,
                after_kv_pool_bytes=(num_pages - 1) * MiB,
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
            before_kv_pool_bytes=(before - 1) * MiB,
            after_kv_pool_bytes=(num_pages - 1) * MiB,
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
    from engine.worker.heartbeat import SharedPipe
    from engine.worker.process import _replan

    engine, conn = ResizableEngine(), FakeConn()
    pipe = SharedPipe(conn)
    _replan(pipe, engine, ipc.ResizePool(seq=7, num_pages=60, reason="game"), 101)
    events, done = conn.sent
    assert isinstance(events, ipc.EngineEvents) and events.events[0].after_pages == 60
    assert events.events[0].origin == BY_WATCHER
    assert isinstance(done, ipc.ControlDone) and done.seq == 7 and done.ok
    assert done.pool is not None and done.pool.pages == 60 and done.pool.planned_pages == 101
    assert done.result is not None and done.result.after_pages == 60
    assert "100 -> 59 pages" in done.message

    conn.sent.clear()
    _replan(pipe, engine, ipc.ResizePool(seq=11, num_pages=50, origin=BY_CONTROL), 101)
    assert conn.sent[0].events[0].origin == BY_CONTROL  # who asked comes back typed

    conn.sent.clear()
    _replan(pipe, engine, ipc.ResizePool(seq=8, num_pages=1), 101)
    (refused,) = conn.sent  # nothing changed: no events
    assert not refused.ok and "at least 2 pages" in refused.message

    conn.sent.clear()
    _replan(pipe, engine, ipc.SetPrefillChunk(seq=9, tokens=512), 101)
    assert conn.sent[-1].ok and conn.sent[-1].pool.prefill_chunk == 512

    conn.sent.clear()
    plain = type("PlainEngine", (), {"stats": lambda self: STATS})()  # cannot resize
    _replan(pipe, plain, ipc.EvictPrefixCache(seq=10, origin=BY_CONTROL), 0)
    (answer,) = conn.sent
    assert not answer.ok and answer.pool is None


def test_planned_page_bytes_come_from_the_plan():
    from engine.worker.process import pool_stats

    engine = ResizableEngine()
    engine.plan = memory_plan(
        ledger=[LedgerEntry("prefill activation peak", 2048 * 1000, "-", "est")],
        budget_bytes=3 * GiB,
        fixed_bytes=GiB,
        kv_pool_bytes=100 * 512 * 1024,
        num_pages=100,
        max_context_tokens=1600,
        min_context_tokens=512,
        max_running_requests=8,
    )
    pool = pool_stats(engine, STATS, 101)
    assert pool is not None
    assert pool.page_bytes == 512 * 1024  # the plan's, not the CPU pool's
    assert pool.fixed_bytes == GiB and pool.activation_bytes_per_token == 1000
    assert simulated_ours_bytes(pool) == GiB + 100 * 512 * 1024
