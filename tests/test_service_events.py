"""Issue 6 end to end: the control plane of a real ``headroom serve`` (the default model on
the CPU, planned for a simulated 4 GiB card whose memory is sampled 10 times a second).

The socket sends a snapshot on connect, then events; the token guards the control
routes and the socket (``/api/status`` stays open); a foreign Origin is refused and the
service's own is not; 50 connect/disconnect cycles while events flow leave no
subscriber and no traceback; a reconnect with ``last_seq`` gets the missed events in
order; ``/api/control/cache`` clears the prefix cache and resizes the KV pool live
(``/v1/models`` follows), ``/api/control/reserve`` moves the reserve, and
``/api/control/restart`` restarts the worker (its events seen on the socket).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from service_harness import ServerProcess, serving, wait_for
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from engine.common.units import MiB

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tmp_path_factory.mktemp("events"),
        [
            "--device-total",
            "4GiB",
            "--max-model-len",
            "2048",
            "--min-context",
            "512",
            "--max-running-requests",
            "8",
            "--vram-source",
            "simulated",
            "--vram-hz",
            "10",
        ],
    )
    yield from serving(proc)


def auth(server: ServerProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def token_protocol(server: ServerProcess) -> list[str]:
    return [f"headroom.token.{server.token}"]


def recv(ws, timeout: float = 60.0) -> dict:
    return json.loads(ws.recv(timeout=timeout))


def subscribers(server: ServerProcess) -> int:
    return server.health().json()["event_subscribers"]


def test_status_is_open_and_is_the_snapshot(server):
    status = httpx.get(server.base_url + "/api/status").json()
    assert status["type"] == "snapshot" and status["epoch"]
    assert status["health"]["status"] == "ready"
    assert status["worker"]["phase"] == "started" and status["worker"]["pid"]
    assert status["engine"]["info"]["model_name"]
    assert status["plan"]["plan"]["fits"] is True
    vram = status["vram"]
    assert vram["source"] == "simulated" and vram["total_bytes"] == 4 << 30
    assert vram["headroom_bytes"] == vram["free_bytes"] - vram["reserve_bytes"]
    assert status["counters"]["engine"]["total_pages"] > 0


def test_socket_sends_a_snapshot_then_events_in_order(server):
    with connect(server.ws_url, subprotocols=token_protocol(server)) as ws:
        assert ws.subprotocol == token_protocol(server)[0]
        snapshot = recv(ws)
        assert snapshot["type"] == "snapshot" and snapshot["health"]["status"] == "ready"
        events = [recv(ws) for _ in range(6)]
    assert [e["seq"] for e in events] == list(range(snapshot["seq"] + 1, snapshot["seq"] + 7))
    assert "vram" in {e["type"] for e in events}


def test_control_and_the_socket_need_the_token(server):
    url = server.base_url
    for headers in ({}, {"Authorization": "Bearer not-the-token-0123456789"}):
        r = httpx.post(url + "/api/control/restart", headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_token"
        r = httpx.post(
            url + "/api/control/cache", json={"clear_prefix_cache": True}, headers=headers
        )
        assert r.status_code == 401
    # The socket without a token (or a wrong one) is closed with 4001 at once.
    for extra in ({}, {"subprotocols": ["headroom.token.wrong-token-0123456789"]}):
        with connect(server.ws_url, **extra) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001
    # ... and works with the token as a query parameter.
    with connect(f"{server.ws_url}?token={server.token}") as ws:
        assert recv(ws)["type"] == "snapshot"
    assert server.worker_pid()  # nothing restarted


@pytest.mark.usefixtures("built_dashboard")
def test_a_foreign_origin_is_refused_and_the_services_own_is_not(server):
    url = server.base_url
    evil = {"Origin": "https://evil.example"}
    r = httpx.post(url + "/api/control/restart", headers={**auth(server), **evil})
    assert r.status_code == 403
    assert httpx.get(url + "/api/status", headers=evil).status_code == 403
    with pytest.raises(InvalidStatus) as refused:
        with connect(server.ws_url, subprotocols=token_protocol(server), origin=evil["Origin"]):
            pass
    assert refused.value.response.status_code == 403
    # The dashboard calling home: the page's own origin on a loopback host.
    own = {"Origin": url}
    assert httpx.get(url + "/ui/", headers=own).status_code == 200
    assert httpx.get(url + "/api/status", headers=own).status_code == 200
    with connect(server.ws_url, subprotocols=token_protocol(server), origin=url) as ws:
        assert recv(ws)["type"] == "snapshot"
    tauri = {"Origin": "tauri://localhost"}
    r = httpx.get(url + "/api/status", headers=tauri)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "tauri://localhost"


def test_fifty_connect_disconnect_cycles_leave_no_subscriber(server):
    watcher_ws = connect(server.ws_url, subprotocols=token_protocol(server))
    with watcher_ws as ws:
        recv(ws)
        assert wait_for(lambda: subscribers(server) == 1, 60, "one subscriber")
        for i in range(50):
            if i % 2:
                with connect(server.ws_url, subprotocols=token_protocol(server)) as other:
                    assert recv(other)["type"] == "snapshot"
                    recv(other)  # an event flowing
            else:
                # Gone without a close frame: the TCP connection just drops.
                with connect(server.ws_url, subprotocols=token_protocol(server)) as other:
                    assert recv(other)["type"] == "snapshot"
                    other.socket.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: subscribers(server) == 1, 60, "only the watching subscriber left")
        # The watching connection kept getting every event, in order.
        seqs = [recv(ws)["seq"] for _ in range(5)]
        assert seqs == list(range(seqs[0], seqs[0] + 5))
    wait_for(lambda: subscribers(server) == 0, 60, "no subscriber left")
    assert "Traceback" not in server.log()


def test_reconnect_with_last_seq_gets_the_missed_events_in_order(server):
    with connect(server.ws_url, subprotocols=token_protocol(server)) as ws:
        snapshot = recv(ws)
        last = [recv(ws) for _ in range(3)][-1]
    # Events flow meanwhile (VRAM samples, 4 a second): another client watches until
    # five more were published.
    with connect(server.ws_url, subprotocols=token_protocol(server)) as watcher:
        seq = recv(watcher)["seq"]
        while seq < last["seq"] + 5:
            seq = recv(watcher, timeout=60)["seq"]
    back_at = time.time()
    query = f"?last_seq={last['seq']}&epoch={snapshot['epoch']}"
    with connect(server.ws_url + query, subprotocols=token_protocol(server)) as ws:
        missed = [recv(ws) for _ in range(5)]
    assert "snapshot" not in {m["type"] for m in missed}
    assert [m["seq"] for m in missed] == list(range(last["seq"] + 1, last["seq"] + 6))
    assert missed[-1]["ts"] <= back_at  # published while it was away
    # Another epoch (a restarted service) gets a fresh snapshot instead.
    with connect(
        f"{server.ws_url}?last_seq={last['seq']}&epoch=another-epoch",
        subprotocols=token_protocol(server),
    ) as ws:
        assert recv(ws)["type"] == "snapshot"


def chat(http: httpx.Client, content: str, max_tokens: int = 4) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )


def test_control_cache_clears_the_prefix_cache_and_resizes_the_pool_live(server):
    http = server.client()
    headers = auth(server)
    # Fill the prefix cache.
    assert chat(http, "Tell me about the Moon. " * 20).status_code == 200
    status = http.get("/api/status").json()
    assert status["counters"]["engine"]["cached_pages"] > 0
    planned = status["engine"]["info"]["num_pages"]
    plan = status["plan"]["plan"]
    page_bytes = plan["kv_pool_bytes"] // plan["num_pages"]

    r = http.post("/api/control/cache", json={"clear_prefix_cache": True}, headers=headers)
    assert r.status_code == 202, r.text
    assert r.json()["action"] == "cache" and "prefix-cache pages freed" in r.json()["message"]
    status = http.get("/api/status").json()
    assert status["counters"]["engine"]["cached_pages"] == 0
    assert status["replans"][-1]["action"] == "clear_prefix_cache"

    # Shrink the pool to 40 pages (the null page apart, as every count says): one request
    # may now hold 40 x 16 tokens.
    r = http.post("/api/control/cache", json={"kv_cache": 40 * page_bytes}, headers=headers)
    assert r.status_code == 202, r.text
    # One count on every surface: the control API's answer, /api/status's engine, counters
    # and plan, the replan event (below) and the worker's log.
    assert f"KV pool {planned} -> 40 pages" in r.json()["message"], r.text
    assert f"KV pool shrunk: {planned} -> 40 pages" in server.log()
    status = http.get("/api/status").json()
    assert status["engine"]["info"]["num_pages"] == status["counters"]["engine"]["total_pages"] == 40
    assert status["plan"]["plan"]["num_pages"] == 40
    assert status["engine"]["info"]["max_context_tokens"] == 40 * 16
    replan = status["replans"][-1]
    assert replan["action"] == "set_kv_cache"
    assert (replan["before"]["num_pages"], replan["after"]["num_pages"]) == (planned, 40)
    model = http.get("/v1/models").json()["data"][0]
    assert model["context_length"] == 40 * 16
    r = chat(http, "word " * 800)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert str(40 * 16) in r.json()["error"]["message"]
    assert chat(http, "Hello!").status_code == 200

    # Too small for one request of the minimum context (512 tokens): 400.
    r = http.post("/api/control/cache", json={"kv_cache": 8 * page_bytes}, headers=headers)
    assert r.status_code == 400 and "smallest" in r.json()["error"]["message"]
    # Past the host's available memory (the engine runs on the CPU, where a pool that
    # does not fit stalls the worker instead of failing): 409 no_room before the worker
    # tries, as a grow past the card's room.
    r = http.post("/api/control/cache", json={"kv_cache": "1TiB"}, headers=headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_room", r.text
    assert "host memory" in r.json()["error"]["message"], r.text
    assert http.get("/api/status").json()["engine"]["info"]["num_pages"] == 40

    # Back to the plan.
    r = http.post("/api/control/cache", json={"kv_cache": None}, headers=headers)
    assert r.status_code == 202, r.text
    assert http.get("/v1/models").json()["data"][0]["context_length"] == 2048
    assert http.get("/api/status").json()["engine"]["info"]["num_pages"] == planned
    http.close()


def test_control_reserve_moves_the_reserve_of_the_vram_events(server):
    headers = auth(server)
    url = server.base_url
    auto = httpx.get(url + "/api/status").json()["vram"]["reserve_bytes"]
    assert auto > 512 * MiB  # 512 MiB + 5% of the card: the simulated card has a display
    r = httpx.post(url + "/api/control/reserve", json={"reserve": "600MiB"}, headers=headers)
    assert r.status_code == 202 and "600 MiB" in r.json()["message"]
    wait_for(
        lambda: httpx.get(url + "/api/status").json()["vram"]["reserve_bytes"] == 600 * MiB,
        60,
        "the new reserve in the vram events",
    )
    r = httpx.post(url + "/api/control/reserve", json={"reserve": "auto"}, headers=headers)
    assert r.status_code == 202
    wait_for(
        lambda: httpx.get(url + "/api/status").json()["vram"]["reserve_bytes"] == auto,
        60,
        "the automatic reserve back",
    )


def test_control_restart_restarts_the_worker_and_the_socket_shows_it(server):
    old = server.worker_pid()
    with connect(server.ws_url, subprotocols=token_protocol(server)) as ws:
        recv(ws)
        r = httpx.post(server.base_url + "/api/control/restart", headers=auth(server))
        assert r.status_code == 202 and r.json()["action"] == "restart"
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            event = recv(ws, timeout=120)
            if event["type"] in ("worker", "health"):
                seen.append(event)
            if event["type"] == "health" and event["status"] == "ready":
                break
    worker = [(e["phase"], e.get("pid")) for e in seen if e["type"] == "worker"]
    health = [e["status"] for e in seen if e["type"] == "health"]
    exited = next(e for e in seen if e["type"] == "worker" and e["phase"] == "exited")
    assert exited["pid"] == old and exited["signal"] == "SIGKILL"
    assert "SIGKILL" in exited["reason"]
    phases = [p for p, _ in worker]
    assert phases.index("exited") < phases.index("restarting") < phases.index("started")
    # Before the new worker planned, the old one's memory was seen released.
    release = [
        e
        for e in seen
        if e["type"] == "worker" and (e.get("reason") or "").startswith("memory of worker")
    ]
    assert release and "released" in release[0]["reason"], seen
    assert "restarting" in health and health[-1] == "ready"
    new = server.worker_pid()
    assert new != old and ("started", new) in worker
    assert server.health().json()["restarts"] == 0  # asked for: no crash to count
