"""Issue 5 end to end, with real ``headroom serve`` processes on the CPU:

- A simulated 4 GiB desktop card (``--vram-source simulated``) plays a timeline: a game
  takes 40% of the card, a browser spikes on top, a wobble inside the band, then both
  leave; meanwhile several clients stream requests. No request fails; the KV pool (as
  ``/api/status`` reports it) shrinks and grows back to the plan; replans are counted
  and do not flap; ``/api/events`` delivers the ``vram`` and ``replan`` events in order.
- ``--device-limit`` on a larger simulated card is a card of that size while serving, as
  in the plan: another process's memory counts against it, the pool shrinks and grows.
- A stale worker: one that outlived its SIGKILLed service (stuck in its load) is ended by the
  next start; an unrelated process listed in the same pid file is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from service_harness import ServerProcess, process_gone, simulated_vram_args, wait_for
from websockets.sync.client import connect

pytestmark = pytest.mark.slow

GiB = 1 << 30
MiB = 1 << 20

# Seconds from the moment the engine is first ready. The game's share wobbles by a few
# tens of MiB while it plays (inside the replan band: no replan may follow it); the
# wobble starts well after the game's arrival (7 s), so the replans that arrival causes
# are done even on a busy machine (the watcher samples nothing while it awaits one), and
# it lasts 6 s in steps of a second, so the sampler sees it even when its loop stalls
# for a few seconds.
TIMELINE = {
    "steps": [
        [0, 0],
        [3, "40%"],
        [10, "39%"],
        [11, "41%"],
        [12, "39.5%"],
        [13, "40.5%"],
        [14, "39%"],
        [15, "41%"],
        [16, "40%"],
        [17, "47%"],  # a browser tab decodes a video on top of the game
        [20, "40%"],
        [24, 0],  # both leave
    ]
}
TIMELINE_END_S = 24
MIN_RESULTS = 8
HOLD_S = 1.0


class EventReader(threading.Thread):
    """Reads ``/api/events`` into ``messages`` from :meth:`start` until :meth:`stop`."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.url = server.ws_url
        self.protocols = [f"headroom.token.{server.token}"]
        self.messages: list[dict] = []
        self.stopping = threading.Event()
        self.connected = threading.Event()

    def start(self) -> None:
        super().start()
        assert self.connected.wait(60), "the event socket did not open"

    def run(self) -> None:
        try:
            with connect(self.url, subprotocols=self.protocols) as ws:
                self.connected.set()
                while not self.stopping.is_set():
                    try:
                        self.messages.append(json.loads(ws.recv(timeout=0.5)))
                    except TimeoutError:
                        continue
        except Exception as exc:  # the connection closed
            self.messages.append({"type": "closed", "error": repr(exc)})

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)


def stream_chat(base_url: str, i: int) -> tuple[bool, str]:
    """One streaming request; (ok, what went wrong)."""
    body = {
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=base_url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}: {r.read()!r}"
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    if not lines or lines[-1] != "data: [DONE]":
        return False, f"no [DONE]: {lines[-2:]}"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    if any("error" in c for c in chunks):
        return False, f"error chunk: {[c for c in chunks if 'error' in c]}"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    if finish not in ("stop", "length"):
        return False, f"finish_reason {finish}"
    return True, ""


class StreamingClients:
    """``n`` threads that stream chat requests to ``base_url`` from construction until
    :meth:`stop`, which returns every request's ``(ok, what went wrong)``."""

    def __init__(self, base_url: str, n: int) -> None:
        self.base_url = base_url
        self.results: list[tuple[bool, str]] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        i = 0
        while not self.stopping.is_set():
            self.results.append(stream_chat(self.base_url, 100 * k + i))
            i += 1

    def stop(self) -> list[tuple[bool, str]]:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=120)
        return self.results


# A model load, the timeline and enough requests: past the default 600 s at a load
# average of 14 on 2 cores.
@pytest.mark.timeout(1800)
def test_simulated_desktop_timeline_shrinks_and_grows_the_pool_without_failing_requests(
    start_server, tmp_path
):
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps(TIMELINE))
    server = start_server([*simulated_vram_args(timeline), "--replan-hold", str(HOLD_S)])
    ready_at = time.monotonic()  # the timeline started a moment ago, at the first ready
    events = EventReader(server)
    events.start()
    http = server.client()
    initial = http.get("/api/status").json()
    planned_pages = initial["engine"]["info"]["num_pages"]
    assert initial["vram"]["source"] == "simulated"
    assert initial["plan"]["plan"]["fits"] is True

    # Clients stream requests for the whole timeline.
    clients = StreamingClients(server.base_url, 4)

    # The pool as /api/status reports it, over the timeline (and until the clients have
    # finished enough requests: a busy machine serves fewer in the same time).
    pages_seen: list[int] = []
    deadline = time.monotonic() + 600
    while time.monotonic() - ready_at < TIMELINE_END_S + 2 or len(clients.results) < MIN_RESULTS:
        assert time.monotonic() < deadline, f"only {len(clients.results)} requests done"
        status = http.get("/api/status").json()
        pages_seen.append(status["engine"]["info"]["num_pages"])
        time.sleep(0.25)
    # Back to the plan once both left (a hold, then the grow).
    wait_for(
        lambda: http.get("/api/status").json()["engine"]["info"]["num_pages"] == planned_pages,
        30,
        "the pool to grow back to the plan",
    )
    results = clients.stop()
    # The last events: the hub's sequence as /api/status shows it has reached the socket.
    last_seq = http.get("/api/status").json()["seq"]
    wait_for(
        lambda: any(m.get("seq", -1) >= last_seq for m in events.messages), 60, "the last events"
    )
    events.stop()
    final = http.get("/api/status").json()
    http.close()

    # No request failed.
    assert len(results) >= MIN_RESULTS, results
    failures = [why for ok, why in results if not ok]
    assert not failures, failures

    # The pool shrank, then grew back to the plan.
    assert min(pages_seen) < planned_pages * 0.6, pages_seen
    assert final["engine"]["info"]["num_pages"] == planned_pages
    assert (
        final["engine"]["info"]["max_prefill_tokens"]
        == initial["engine"]["info"]["max_prefill_tokens"]
    )

    # The events: a snapshot, then vram and replan events in order, seq increasing by 1.
    messages = [m for m in events.messages if m["type"] != "closed"]
    assert messages[0]["type"] == "snapshot"
    seqs = [m["seq"] for m in messages[1:]]
    assert seqs == list(range(messages[0]["seq"] + 1, messages[0]["seq"] + 1 + len(seqs)))
    kinds = {m["type"] for m in messages}
    assert {"vram", "replan"} <= kinds, kinds
    vram = [m for m in messages if m["type"] == "vram"]
    assert all(v["source"] == "simulated" for v in vram)
    assert max(v["others_bytes"] for v in vram) >= int(0.4 * 4 * GiB) - 64 * MiB
    replans = [m for m in messages if m["type"] == "replan"]
    actions = [r["action"] for r in replans]
    pool_moves = [r for r in replans if r["action"] in ("shrink_kv", "grow_kv")]
    assert pool_moves[0]["action"] == "shrink_kv" and pool_moves[-1]["action"] == "grow_kv"
    assert actions.index("lower_chunk_cap") < actions.index("shrink_kv")
    assert actions[-1] == "raise_chunk_cap"
    for r in pool_moves:
        shrank = r["after"]["num_pages"] < r["before"]["num_pages"]
        assert shrank == (r["action"] == "shrink_kv"), r
        assert r["reason"]
    # Replans are counted, and the same ones are in the snapshot.
    assert final["counters"]["replans"] == len(replans)
    assert [r["seq"] for r in final["replans"]] == [r["seq"] for r in replans][-20:]

    # No flapping: the game's wobble moved nothing; a few shrinks (game, browser), a few
    # grows (browser gone, game gone); the pool changed direction at most three times.
    shrinks = actions.count("shrink_kv")
    grows = actions.count("grow_kv")
    assert 1 <= shrinks <= 5, actions
    assert 1 <= grows <= 3, actions
    assert len(replans) <= 12, actions
    directions = [r["action"] for r in pool_moves]
    turns = sum(1 for a, b in zip(directions, directions[1:], strict=False) if a != b)
    assert turns <= 3, directions
    total = vram[0]["total_bytes"]
    wobbling = [
        v["ts"]
        for v in vram
        if 0.385 * total <= v["others_bytes"] <= 0.415 * total
        and abs(v["others_bytes"] - 0.40 * total) > MiB
    ]
    assert wobbling, "the sampler never saw the wobble"
    wobble_start = wobbling[0]
    wobble_end = next(v["ts"] for v in vram if v["others_bytes"] > 0.45 * total)
    assert wobble_start < wobble_end
    # The wobble must not turn the pool around. On a loaded machine a resize takes
    # seconds (7 s for the first shrink in one CI run), so the shrinks that answer the
    # game's arrival, decided as it ramped up, may still land in the window: shrinks
    # there are the pool catching up, a grow would be flapping.
    in_wobble = [r["action"] for r in replans if wobble_start < r["ts"] < wobble_end]
    assert all(a == "shrink_kv" for a in in_wobble) and len(in_wobble) <= 2, (in_wobble, actions)
    moves = ", ".join(
        f"{r['action']} {r['before']['num_pages']}->{r['after']['num_pages']}" for r in pool_moves
    )
    print(
        f"replans: {actions} ({moves}); pool pages {planned_pages} -> min {min(pages_seen)} -> "
        f"{final['engine']['info']['num_pages']}; {len(results)} requests, all ok"
    )


# -- --device-limit: a card of that size while serving, as in the plan ----------------------


def test_device_limit_is_a_card_of_that_size_while_serving(start_server, tmp_path):
    """``--device-limit 4GiB`` on a simulated 8 GiB card: the plan, the watcher and the
    replan controller all read a 4 GiB card. Another process takes 1.5 GiB (plenty is
    free on the 8 GiB card, none on a 4 GiB one), then frees it: the pool shrinks and
    grows back to the plan, no request fails, and ``/api/status`` states the rule."""
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"steps": [[0, 0], [3, "1.5GiB"], [10, 0]]}))
    flags = "--device-total 8GiB --device-limit 4GiB --max-model-len 2048 --vram-source simulated"
    server = start_server([*flags.split(), "--vram-timeline", str(timeline), "--replan-hold", "1"])
    http = server.client()
    initial = wait_for(
        lambda: (s := http.get("/api/status").json())["vram"] is not None and s, 30, "a vram sample"
    )
    planned_pages = initial["engine"]["info"]["num_pages"]
    ledger = {e["name"]: e["bytes"] for e in initial["plan"]["plan"]["ledger"]}
    assert ledger["device total"] == 4 * GiB
    vram = initial["vram"]
    assert (vram["total_bytes"], vram["device_limit_bytes"]) == (4 * GiB, 4 * GiB)
    assert "a card of 4.00 GiB" in vram["memory_rule"]

    clients = StreamingClients(server.base_url, 3)
    pages = lambda: http.get("/api/status").json()["engine"]["info"]["num_pages"]  # noqa: E731
    shrunk = wait_for(lambda: (p := pages()) < planned_pages and p, 90, "the pool to shrink")
    wait_for(lambda: pages() == planned_pages, 120, "the pool to grow back to the plan")
    results = clients.stop()
    final = http.get("/api/status").json()
    http.close()

    failures = [why for ok, why in results if not ok]
    assert results and not failures, failures
    # What was taken (1.5 GiB) came out of the pool, less the headroom the plan had left.
    page_bytes = initial["engine"]["info"]["kv_cache_bytes"] // planned_pages
    assert (planned_pages - shrunk) * page_bytes >= GiB, (planned_pages, shrunk)
    actions = [r["action"] for r in final["replans"]]
    assert "shrink_kv" in actions and "grow_kv" in actions, actions
    assert final["engine"]["info"]["num_pages"] == planned_pages


# -- a stale worker of a killed service -------------------------------------------------------


def test_stale_worker_of_a_killed_service_is_reaped_at_the_next_start(start_server, tmp_path):
    from service.supervision.stale import read_pidfile, record_worker

    pidfile = tmp_path / "runtime" / "workers.json"
    first = start_server(env={"HEADROOM_FAKE_ORPHAN": "1"}, fake=True, wait=False)
    record = wait_for(
        lambda: [r for r in read_pidfile(pidfile) if r.service_pid == first.proc.pid],
        60,
        "the worker in the pid file",
    )
    orphan = record[0].pid
    wait_for(lambda: "stuck in the load" in first.log(), 60, "the worker to hang")
    first.proc.send_signal(signal.SIGKILL)  # no cleanup runs
    first.proc.wait()
    time.sleep(0.5)
    assert not process_gone(orphan), "the stuck worker should have outlived its service"

    # A lookalike: a process with a worker-ish command line, listed as if by a dead service.
    lookalike = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "headroom-worker"],
    )
    try:
        record_worker(lookalike.pid, pidfile, service_pid=first.proc.pid, wait_s=0.2)
        second = start_server(fake=True)
        wait_for(lambda: process_gone(orphan), 60, "the stale worker to end")
        log = second.log()
        assert f"stale worker check: pid {orphan} ended" in log, log
        assert f"stale worker check: pid {lookalike.pid} left alone" in log, log
        assert lookalike.poll() is None, "the lookalike must be left alone"
        # The pid file now lists the new worker only.
        pids = {r.pid for r in read_pidfile(pidfile)}
        assert pids == {second.worker_pid()}, pids
    finally:
        lookalike.kill()
        lookalike.wait()
        if not process_gone(orphan):
            os.kill(orphan, signal.SIGKILL)
