"""The event hub (pure asyncio): publishing and the snapshot, the events' shapes,
subscribers and resuming, slow subscribers, and the VRAM throttle. The routes over the
hub are tested in test_events_api.py, the schema's drift guard in test_event_schema.py,
the token file in test_token_file.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from event_samples import health, vram
from service_harness import engine_info, engine_stats, memory_plan

from engine.common.units import GiB, MiB
from engine.wire.messages import OomEvent
from service.events import schemas
from service.events.hub import EventHub, VramThrottle
from service.events.schemas import (
    CLOSE_GOING_AWAY,
    CLOSE_TOO_SLOW,
    CountersEvent,
    EngineInfoEvent,
    HealthEvent,
    PlanEvent,
    PlanPoint,
    ReplanEvent,
    RequestErrorEvent,
    VramEvent,
    WorkerEvent,
)
from service.events.subscription import SubscriptionClosed


def run(coro):
    return asyncio.run(coro)


# -- publishing, snapshot ------------------------------------------------------------------------


def test_publish_stamps_seq_and_ts_and_snapshot_holds_latest():
    now = [1000.0]
    hub = EventHub(clock=lambda: now[0])
    first = hub.publish(health("starting"))
    now[0] = 1001.5
    second = hub.publish(health("ready"))
    assert (first.seq, first.ts, second.seq, second.ts) == (1, 1000.0, 2, 1001.5)
    hub.publish(
        WorkerEvent(phase="exited", pid=41, signal="SIGKILL", reason="was killed by SIGKILL")
    )
    hub.publish(WorkerEvent(phase="started", pid=42))
    hub.publish(PlanEvent(plan=memory_plan()))
    hub.publish(EngineInfoEvent(info=engine_info()))
    hub.publish(CountersEvent(engine=None, in_flight=3))
    for i in range(60):
        hub.publish(
            RequestErrorEvent(
                request_id=f"r{i}", code="out_of_memory", message="x", action="failed"
            )
        )
    before = PlanPoint(kv_pool_bytes=10 * GiB, num_pages=1000, max_prefill_tokens=2048)
    hub.publish(ReplanEvent(action="shrink_kv", reason="game", before=before, after=before))
    snap = hub.snapshot()
    assert snap.seq == hub.seq == 68
    assert snap.epoch == hub.epoch
    assert snap.health is not None and snap.health.status == "ready" and snap.health.seq == 2
    assert snap.worker is not None and snap.worker.pid == 42
    assert snap.last_exit is not None and (snap.last_exit.pid, snap.last_exit.signal) == (
        41,
        "SIGKILL",
    )
    assert snap.plan is not None and snap.plan.plan == memory_plan()
    assert snap.engine is not None and snap.engine.info.model_name == "m"
    assert snap.counters is not None and snap.counters.in_flight == 3
    assert [e.request_id for e in snap.request_errors] == [f"r{i}" for i in range(10, 60)]
    assert [r.action for r in snap.replans] == ["shrink_kv"]
    # Every frame decodes back to its type.
    text = schemas.encode(snap)
    assert schemas.message_decoder.decode(text) == snap
    assert json.loads(text)["type"] == "snapshot"


def test_events_from_engine_and_supervisor_shapes():
    oom = OomEvent(
        request_id="a-0", phase="prefill", tokens_in_step=512, action="failed", message="m"
    )
    event = RequestErrorEvent.from_oom(oom, bytes_asked=64 * MiB, headroom_bytes=-MiB)
    assert (event.code, event.phase, event.action, event.bytes_asked) == (
        "out_of_memory",
        "prefill",
        "failed",
        64 * MiB,
    )
    report = {
        "status": "restarting",
        "worker_pid": None,
        "restarts": 2,
        "in_flight": 0,
        "retry_after_s": 3,
        "model": "m",
    }
    h = HealthEvent.from_report(report)
    assert (h.status, h.restarts, h.retry_after_s, h.model) == ("restarting", 2, 3, "m")
    stats = engine_stats(running=1, free_pages=1, total_pages=2, finished=5)
    c = CountersEvent(engine=stats)
    assert schemas.message_decoder.decode(schemas.encode(c)) == c


def test_vram_event_from_a_watcher_sample():
    from types import SimpleNamespace as NS

    sample = NS(
        gpu=True,
        device="RTX (GPU 0)",
        total_bytes=16 * GiB,
        free_bytes=3 * GiB,
        ours_bytes=9 * GiB,
        others_bytes=4 * GiB,
        top_consumers=(NS(pid=7, name="game", bytes=3 * GiB),),
        reason="",
    )
    e = VramEvent.from_sample(sample, GiB)
    assert (e.source, e.headroom_bytes, e.top_consumers[0].name, e.reason) == (
        "nvml",
        2 * GiB,
        "game",
        None,
    )
    nothing = dict.fromkeys(("total_bytes", "free_bytes", "ours_bytes", "others_bytes"), 0)
    cpu = NS(gpu=False, reason="no NVIDIA driver", **nothing)
    e = VramEvent.from_sample(cpu, 0, source="simulated")
    assert (e.source, e.device, e.reason) == ("none", "no GPU", "no NVIDIA driver")


def test_subscriber_receives_in_order_and_unsubscribe_leaves_nothing():
    async def go():
        hub = EventHub()
        sub = hub.subscribe()
        assert sub.needs_snapshot and sub.snapshot is not None and sub.snapshot.seq == 0
        for _ in range(5):
            hub.publish(health())
        got = [(await sub.get()).event.seq for _ in range(5)]
        assert got == [1, 2, 3, 4, 5]
        sub.close()
        sub.close()  # idempotent
        assert hub.subscriber_count == 0
        with pytest.raises(SubscriptionClosed):
            await sub.get()
        hub.publish(health())  # nothing is delivered to it any more
        assert sub.pending == 0

    run(go())


def test_resume_gets_missed_events_in_order():
    hub = EventHub(buffer_size=8)
    for _ in range(5):
        hub.publish(health())
    sub = hub.subscribe(last_seq=2, epoch=hub.epoch)
    assert not sub.needs_snapshot
    assert [p.event.seq for p in sub.missed] == [3, 4, 5]
    assert [json.loads(p.text)["seq"] for p in sub.missed] == [3, 4, 5]
    # Up to date: nothing missed, no snapshot.
    now = hub.subscribe(last_seq=5, epoch=hub.epoch)
    assert not now.needs_snapshot and now.missed == []
    # Without an epoch the seq alone is trusted.
    assert [p.event.seq for p in hub.subscribe(last_seq=4).missed] == [5]


@pytest.mark.parametrize(
    "case",
    ["too_old", "other_epoch", "future", "negative"],
)
def test_resume_falls_back_to_snapshot(case):
    hub = EventHub(buffer_size=4)
    for _ in range(10):
        hub.publish(health())
    last_seq, epoch = {
        "too_old": (2, hub.epoch),  # events 3..6 are gone (buffer holds 7..10)
        "other_epoch": (9, "another-run"),
        "future": (11, hub.epoch),
        "negative": (-1, hub.epoch),
    }[case]
    sub = hub.subscribe(last_seq=last_seq, epoch=epoch)
    assert sub.needs_snapshot and sub.snapshot is not None and sub.snapshot.seq == 10
    assert sub.missed == []
    # The oldest still-buffered boundary resumes.
    assert [p.event.seq for p in hub.subscribe(last_seq=6, epoch=hub.epoch).missed] == [7, 8, 9, 10]


def test_slow_subscriber_is_dropped_with_close_code_and_others_unaffected():
    async def go():
        hub = EventHub(queue_size=8)
        slow = hub.subscribe()
        fast = hub.subscribe()
        got = []
        for _ in range(20):
            hub.publish(health())
            got.append((await fast.get()).event.seq)
        assert got == list(range(1, 21))
        assert slow.closed and slow.close_code == CLOSE_TOO_SLOW == 4008
        assert hub.subscriber_count == 1 and hub.dropped == 1
        assert slow.closed_event.is_set()
        with pytest.raises(SubscriptionClosed) as info:
            await slow.get()
        assert info.value.code == CLOSE_TOO_SLOW
        fast.close()

    run(go())


def test_hub_close_ends_subscribers_and_refuses_new_ones():
    async def go():
        hub = EventHub()
        sub = hub.subscribe()
        waiter = asyncio.ensure_future(sub.get())
        await asyncio.sleep(0)
        hub.close()
        with pytest.raises(SubscriptionClosed) as info:
            await waiter
        assert info.value.code == CLOSE_GOING_AWAY
        with pytest.raises(RuntimeError):
            hub.subscribe()

    run(go())


def test_fifty_connect_disconnect_cycles_while_events_flow_leave_nothing_behind():
    async def go():
        hub = EventHub(queue_size=64)
        stop = asyncio.Event()
        baseline = len(asyncio.all_tasks())

        async def publisher():
            while not stop.is_set():
                hub.publish(CountersEvent(in_flight=hub.seq))
                await asyncio.sleep(0)

        async def client(n_events: int, received: list[int]):
            with hub.subscribe() as sub:
                for _ in range(n_events):
                    received.append((await sub.get()).event.seq)

        async def reader(sub):
            seqs = []
            while True:
                try:
                    seqs.append((await sub.get()).event.seq)
                except SubscriptionClosed:
                    return seqs

        pub = asyncio.ensure_future(publisher())
        held = [hub.subscribe() for _ in range(3)]  # long-lived readers
        readers = [asyncio.ensure_future(reader(s)) for s in held]
        for cycle in range(50):
            received: list[int] = []
            tasks = [asyncio.ensure_future(client(5 + cycle % 4, received)) for _ in range(4)]
            await asyncio.sleep(0)
            assert hub.subscriber_count == len(held) + 4
            if cycle % 2:
                await asyncio.gather(*tasks)  # they leave after a few events
            else:
                for t in tasks:  # they vanish mid-stream
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            assert hub.subscriber_count == len(held)
        stop.set()
        await pub
        assert hub.dropped == 0
        for sub in held:
            sub.close()
        for seqs in await asyncio.gather(*readers):
            assert seqs == list(range(1, len(seqs) + 1))  # all of them, in order
            assert len(seqs) > 100
        assert hub.subscriber_count == 0
        assert len(asyncio.all_tasks()) == baseline

    run(go())


# -- VRAM coalescing ----------------------------------------------------------------------------


def test_vram_throttle_rate_threshold_and_min_gap():
    t = VramThrottle(max_per_s=4.0, threshold_bytes=256 * MiB, min_gap_s=0.05)
    assert t.offer(vram(8 * GiB), 0.0) == (True, None)
    t.published(vram(8 * GiB), 0.0)
    # A small change within the interval is held until 0.25 s.
    assert t.offer(vram(8 * GiB - 10 * MiB), 0.1) == (False, 0.25)
    assert t.offer(vram(8 * GiB - 20 * MiB), 0.2) == (False, 0.25)
    assert t.take_due() == vram(8 * GiB - 20 * MiB)  # the latest one
    assert t.offer(vram(8 * GiB - 30 * MiB), 0.26) == (True, None)
    t.published(vram(8 * GiB - 30 * MiB), 0.26)
    # A big change goes out at once, but not closer than min_gap_s.
    assert t.offer(vram(5 * GiB), 0.28) == (False, pytest.approx(0.31))
    assert t.offer(vram(5 * GiB), 0.32) == (True, None)


def test_hub_coalesces_vram_and_flushes_the_last_sample():
    max_per_s = 10.0

    async def go():
        hub = EventHub(vram_throttle=VramThrottle(max_per_s=max_per_s, threshold_bytes=GiB))
        sub = hub.subscribe()
        loop = asyncio.get_running_loop()
        start = loop.time()
        free = 8 * GiB
        published = 0
        while loop.time() - start < 0.5:  # a 1 kHz stream of small changes
            free -= MiB
            hub.publish(vram(free))
            published += 1
            await asyncio.sleep(0.001)
        # The held sample is flushed: wait for the last value, however slow the machine.
        seen = []
        while not seen or seen[-1].free_bytes != free:
            seen.append((await asyncio.wait_for(sub.get(), 30)).event)
        elapsed = loop.time() - start
        # At most one sample per 1/max_per_s of the time it took, plus the first and the flush.
        assert len(seen) <= elapsed * max_per_s + 2, (len(seen), elapsed)
        assert len(seen) < published, (len(seen), published)
        assert sub.pending == 0
        # A change past the threshold goes out at once once the minimum gap (0.05 s) has
        # passed; sleeping longer on a slow machine only makes that truer.
        await asyncio.sleep(0.06)
        hub.publish(vram(free - 2 * GiB))
        assert sub.pending == 1
        # coalesce=False bypasses the throttle.
        assert hub.publish(vram(free - 2 * GiB - MiB), coalesce=False) is not None
        sub.close()
        hub.close()

    run(go())


def test_publish_threadsafe():
    async def go():
        hub = EventHub()
        hub.attach_loop()
        sub = hub.subscribe()
        await asyncio.to_thread(hub.publish_threadsafe, health())
        got = await asyncio.wait_for(sub.get(), 2)
        assert got.event.seq == 1

    run(go())
