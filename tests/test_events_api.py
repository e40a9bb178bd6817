"""The control plane's router (service/control/routes.py) on a tiny standalone Litestar app
with a fake ControlTarget: token and Origin checks, the control bodies, the event
socket (snapshot, resume, slow-client drop, 50 connect/disconnect cycles) and the
dashboard's files. The real supervisor is wired in later; this tests the router."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from litestar import Litestar
from litestar.exceptions import WebSocketDisconnect
from litestar.testing import TestClient

from service.common.errors import APIError
from service.control.routes import events_router
from service.events.hub import EventHub
from service.events.schemas import (
    CLOSE_ORIGIN_REFUSED,
    CLOSE_TOO_SLOW,
    CLOSE_UNAUTHORIZED,
    CountersEvent,
    HealthEvent,
    WorkerEvent,
)
from service.http.dashboard import UI_CSP, dashboard_router

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeTarget:
    """Records the calls; ``fail`` makes the next call raise it."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.fail: Exception | None = None

    def _record(self, call: Any) -> str | None:
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.calls.append(call)
        return f"did {call}"

    def restart(self) -> str | None:
        return self._record("restart")

    async def set_reserve(self, reserve: int | str) -> str | None:
        await asyncio.sleep(0)
        return self._record(("reserve", reserve))

    def set_kv_cache(self, kv_cache_bytes: int | None) -> str | None:
        return self._record(("kv_cache", kv_cache_bytes))

    def clear_prefix_cache(self) -> str | None:
        return self._record("clear_prefix_cache")


def make_app(hub: EventHub, target: FakeTarget, **kw: Any) -> Litestar:
    return Litestar(
        route_handlers=[
            events_router(hub, target, token=TOKEN, allowed_origins=["app://custom"], **kw),
            dashboard_router(),
        ],
        openapi_config=None,
        logging_config=None,
    )


@pytest.fixture
def env():
    hub = EventHub(queue_size=64)
    target = FakeTarget()
    with TestClient(make_app(hub, target), timeout=10) as client:
        yield hub, target, client


def publish(client: TestClient, hub: EventHub, *events: Any) -> None:
    """Publish on the app's event loop (the hub is not thread-safe)."""

    def go() -> None:
        for event in events:
            hub.publish(event, coalesce=False)

    client.blocking_portal.call(go)


def wait_for(predicate, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.01)


# -- HTTP ---------------------------------------------------------------------------------


def test_status_is_the_snapshot(env):
    hub, _, client = env
    publish(client, hub, HealthEvent(status="ready", model="m"))
    body = client.get("/api/status").json()
    assert body["type"] == "snapshot" and body["seq"] == 1 and body["epoch"] == hub.epoch
    assert body["health"]["status"] == "ready"


def test_status_can_require_the_token():
    hub, target = EventHub(), FakeTarget()
    with TestClient(make_app(hub, target, status_requires_token=True)) as client:
        assert client.get("/api/status").status_code == 401
        assert client.get("/api/status", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("route", "body"),
    [("restart", None), ("reserve", {"reserve": "auto"}), ("cache", {"clear_prefix_cache": True})],
)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-token-xxxxxxxxxxxx", f"Basic {TOKEN}", "Bearer "]
)
def test_control_without_a_valid_token_is_401(env, route, body, auth):
    _, target, client = env
    headers = {"Authorization": auth} if auth else {}
    r = client.post(f"/api/control/{route}", json=body, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_token"
    assert target.calls == []


def test_control_from_a_foreign_origin_is_403_even_with_the_token(env):
    _, target, client = env
    r = client.post("/api/control/restart", headers={**AUTH, "Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    for origin in ("tauri://localhost", "https://tauri.localhost", "app://custom"):
        assert (
            client.post("/api/control/restart", headers={**AUTH, "Origin": origin}).status_code
            == 202
        )
    assert target.calls == ["restart"] * 3


def test_control_actions_reach_the_target(env):
    _, target, client = env
    r = client.post("/api/control/restart", headers=AUTH)
    assert r.status_code == 202 and r.json() == {
        "ok": True,
        "action": "restart",
        "message": "did restart",
    }
    assert (
        client.post("/api/control/reserve", json={"reserve": "auto"}, headers=AUTH).status_code
        == 202
    )
    assert (
        client.post("/api/control/reserve", json={"reserve": "1.5GiB"}, headers=AUTH).status_code
        == 202
    )
    assert (
        client.post("/api/control/reserve", json={"reserve": 1024}, headers=AUTH).status_code == 202
    )
    assert (
        client.post("/api/control/cache", json={"kv_cache": "6GiB"}, headers=AUTH).status_code
        == 202
    )
    r = client.post(
        "/api/control/cache", json={"kv_cache": None, "clear_prefix_cache": True}, headers=AUTH
    )
    assert r.status_code == 202 and r.json()["action"] == "cache"
    assert target.calls == [
        "restart",
        ("reserve", "auto"),
        ("reserve", int(1.5 * (1 << 30))),
        ("reserve", 1024),
        ("kv_cache", 6 << 30),
        ("kv_cache", None),  # the sizes first, the prefix cache cleared last
        "clear_prefix_cache",
    ]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("reserve", {}, "reserve"),
        ("reserve", {"reserve": "lots"}, "reserve"),
        ("reserve", {"reserve": -1}, "reserve"),
        ("reserve", {"reserve": "auto", "extra": 1}, None),
        ("cache", {}, None),
        ("cache", {"kv_cache": "big"}, "kv_cache"),
        ("cache", {"clear_prefix_cache": "yes"}, "clear_prefix_cache"),
        ("cache", {"kv_cache": 1.5}, "kv_cache"),  # refused in the size parser's words
        ("cache", {"expert_cache": 0.5}, "expert_cache"),
        ("reserve", {"reserve": 1.5}, "reserve"),
    ],
)
def test_control_bad_bodies_are_400(env, route, body, param):
    _, target, client = env
    r = client.post(f"/api/control/{route}", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if isinstance(body.get(param), float):
        assert "is not a whole number of bytes: write" in r.json()["error"]["message"], r.text
    assert target.calls == []


def test_control_target_errors_map_to_statuses(env):
    _, target, client = env
    target.fail = APIError(409, "the engine is restarting", code="busy")
    r = client.post("/api/control/restart", headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "busy")
    target.fail = ValueError("the KV pool cannot be smaller than one request")
    r = client.post("/api/control/cache", json={"kv_cache": 1}, headers=AUTH)
    assert r.status_code == 400 and "smaller" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_cache"  # the body's field at fault
    target.fail = ValueError("a reserve of 100 GiB leaves nothing of the card")
    r = client.post("/api/control/reserve", json={"reserve": "100GiB"}, headers=AUTH)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "reserve")
    target.fail = NotImplementedError("no live resize yet")
    r = client.post("/api/control/cache", json={"kv_cache": 1}, headers=AUTH)
    assert r.status_code == 501


# -- the event socket -------------------------------------------------------------------------


def test_socket_refuses_a_foreign_origin(env):
    hub, _, client = env
    with pytest.raises(WebSocketDisconnect) as info:
        with client.websocket_connect(
            "/api/events", headers={**AUTH, "Origin": "https://evil.example"}
        ) as ws:
            ws.receive_json()
    assert info.value.code == CLOSE_ORIGIN_REFUSED
    assert hub.subscriber_count == 0


@pytest.mark.parametrize(
    ("origin", "host", "ok"),
    [
        ("http://127.0.0.1:8427", "127.0.0.1:8427", True),  # the dashboard at /ui
        ("http://localhost:8427", "localhost:8427", True),
        ("http://127.0.0.1:8427", "127.0.0.1:9999", False),  # another local port
        ("http://evil.example:8427", "evil.example:8427", False),  # DNS rebinding
        ("file://", "127.0.0.1:8427", False),
    ],
)
def test_the_services_own_origin_is_allowed_on_a_loopback_host(env, origin, host, ok):
    hub, target, client = env
    headers = {**AUTH, "Origin": origin, "Host": host}
    r = client.post("/api/control/restart", headers=headers)
    assert r.status_code == (202 if ok else 403)
    if ok:
        with client.websocket_connect("/api/events", headers=headers) as ws:
            assert ws.receive_json()["type"] == "snapshot"
    else:
        with pytest.raises(WebSocketDisconnect) as info:
            with client.websocket_connect("/api/events", headers=headers) as ws:
                ws.receive_json()
        assert info.value.code == CLOSE_ORIGIN_REFUSED


def test_a_plain_get_on_the_socket_is_426_upgrade_required(env):
    """A browser tab or curl on the WebSocket route learns what it is (not a 405), and
    the socket itself still opens."""
    _, _, client = env
    answer = client.get("/api/events")
    assert answer.status_code == 426 and answer.headers["upgrade"] == "websocket"
    assert answer.json()["error"]["code"] == "upgrade_required"
    with client.websocket_connect("/api/events", params={"token": TOKEN}) as ws:
        assert ws.receive_json()["type"] == "snapshot"


@pytest.mark.parametrize("how", ["none", "wrong_subprotocol", "wrong_query", "wrong_bearer"])
def test_socket_without_a_valid_token_is_closed_4001(env, how):
    hub, _, client = env
    kw: dict[str, Any] = {
        "none": {},
        "wrong_subprotocol": {"subprotocols": ["headroom.token.nope-nope-nope-nope"]},
        "wrong_query": {"params": {"token": "nope"}},
        "wrong_bearer": {"headers": {"Authorization": "Bearer nope"}},
    }[how]
    with pytest.raises(WebSocketDisconnect) as info:
        with client.websocket_connect("/api/events", **kw) as ws:
            ws.receive_json()
    assert info.value.code == CLOSE_UNAUTHORIZED
    assert hub.subscriber_count == 0


@pytest.mark.parametrize("how", ["subprotocol", "query", "bearer"])
def test_socket_snapshot_on_connect_then_events(env, how):
    hub, _, client = env
    publish(client, hub, HealthEvent(status="starting"))
    kw: dict[str, Any] = {
        "subprotocol": {"subprotocols": ["headroom.v1", f"headroom.token.{TOKEN}"]},
        "query": {"params": {"token": TOKEN}},
        "bearer": {"headers": {**AUTH, "Origin": "tauri://localhost"}},
    }[how]
    with client.websocket_connect("/api/events", **kw) as ws:
        if how == "subprotocol":
            assert ws.accepted_subprotocol == f"headroom.token.{TOKEN}"
        first = ws.receive_json()
        assert first["type"] == "snapshot" and first["seq"] == 1
        assert first["health"]["status"] == "starting"
        wait_for(lambda: hub.subscriber_count == 1)
        publish(client, hub, HealthEvent(status="ready"), WorkerEvent(phase="started", pid=7))
        assert [ws.receive_json()["type"] for _ in range(2)] == ["health", "worker"]
    wait_for(lambda: hub.subscriber_count == 0)


def test_socket_resume_gets_missed_events_in_order_or_a_snapshot(env):
    hub, _, client = env
    publish(client, hub, *[CountersEvent(in_flight=i) for i in range(3)])
    url = f"/api/events?token={TOKEN}"
    with client.websocket_connect(url) as ws:
        snap = ws.receive_json()
        assert snap["seq"] == 3
        epoch = snap["epoch"]
        publish(client, hub, CountersEvent(in_flight=3))
        last = ws.receive_json()["seq"]
    wait_for(lambda: hub.subscriber_count == 0)
    publish(client, hub, *[CountersEvent(in_flight=i) for i in range(4, 9)])  # missed: 5..9
    with client.websocket_connect(f"{url}&last_seq={last}&epoch={epoch}") as ws:
        frames = [ws.receive_json() for _ in range(5)]
        assert [f["type"] for f in frames] == ["counters"] * 5
        assert [f["seq"] for f in frames] == [5, 6, 7, 8, 9]
        assert [f["in_flight"] for f in frames] == [4, 5, 6, 7, 8]
    # Another run's epoch, a seq too old for the buffer, or junk: a fresh snapshot.
    publish(client, hub, *[CountersEvent() for _ in range(70)])  # buffer 1024: still there
    for query in ("&last_seq=2&epoch=other", "&last_seq=junk", f"&last_seq=999999&epoch={epoch}"):
        with client.websocket_connect(url + query) as ws:
            frame = ws.receive_json()
            assert frame["type"] == "snapshot" and frame["seq"] == 79


def test_socket_resume_too_old_gets_snapshot():
    hub, target = EventHub(buffer_size=4), FakeTarget()
    with TestClient(make_app(hub, target)) as client:
        publish(client, hub, *[CountersEvent() for _ in range(10)])
        with client.websocket_connect(
            f"/api/events?token={TOKEN}&last_seq=3&epoch={hub.epoch}"
        ) as ws:
            frame = ws.receive_json()
            assert frame["type"] == "snapshot" and frame["seq"] == 10
        with client.websocket_connect(
            f"/api/events?token={TOKEN}&last_seq=6&epoch={hub.epoch}"
        ) as ws:
            assert [ws.receive_json()["seq"] for _ in range(4)] == [7, 8, 9, 10]


def test_slow_socket_is_dropped_with_4008():
    hub, target = EventHub(queue_size=16), FakeTarget()
    with TestClient(make_app(hub, target)) as client:
        with pytest.raises(WebSocketDisconnect) as info:
            with client.websocket_connect(f"/api/events?token={TOKEN}") as ws:
                assert ws.receive_json()["type"] == "snapshot"
                wait_for(lambda: hub.subscriber_count == 1)
                # 100 events in one go, without yielding: more than its queue holds.
                publish(client, hub, *[CountersEvent() for _ in range(100)])
                while True:
                    ws.receive_json()
        assert info.value.code == CLOSE_TOO_SLOW
        assert hub.dropped == 1
        wait_for(lambda: hub.subscriber_count == 0)


@pytest.mark.timeout(120)
def test_fifty_socket_cycles_while_events_flow_leave_no_subscriber_or_task(env, caplog):
    hub, _, client = env
    portal = client.blocking_portal
    stop = asyncio.Event()

    async def publisher() -> None:
        while not stop.is_set():
            hub.publish(CountersEvent(in_flight=hub.seq))
            # 100 events/s: socket b reads nothing but its snapshot, so a faster flow
            # could fill its queue on a loaded machine and drop it (a different test).
            await asyncio.sleep(0.01)

    async def task_count() -> int:
        return len(asyncio.all_tasks())

    baseline = portal.call(task_count)
    future = portal.start_task_soon(publisher)
    url = f"/api/events?token={TOKEN}"
    last: tuple[int, str] | None = None
    for cycle in range(50):
        with client.websocket_connect(url) as a, client.websocket_connect(url) as b:
            snap = a.receive_json()
            assert snap["type"] == "snapshot"
            assert b.receive_json()["type"] == "snapshot"
            wait_for(lambda: hub.subscriber_count == 2)
            frames = [a.receive_json() for _ in range(3)]
            seqs = [f["seq"] for f in frames]
            assert seqs == sorted(seqs) and seqs[0] > snap["seq"] - 1
            last = (seqs[-1], snap["epoch"])
            if cycle % 2:
                b.close()  # one leaves early
                wait_for(lambda: hub.subscriber_count == 1)
        wait_for(lambda: hub.subscriber_count == 0)
    # The last client resumes with its seq and gets every event after it, in order.
    assert last is not None
    with client.websocket_connect(f"{url}&last_seq={last[0]}&epoch={last[1]}") as ws:
        frames = [ws.receive_json() for _ in range(20)]
        assert frames[0]["type"] == "counters"
        assert [f["seq"] for f in frames] == list(range(last[0] + 1, last[0] + 21))
    wait_for(lambda: hub.subscriber_count == 0)
    portal.call(stop.set)
    future.result(timeout=60)
    wait_for(lambda: portal.call(task_count) <= baseline)
    assert hub.dropped == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]


# -- the dashboard ----------------------------------------------------------------------------


@pytest.mark.usefixtures("built_dashboard")
def test_dashboard_files(env):
    _, _, client = env
    r = client.get("/ui", follow_redirects=False)
    assert r.status_code in (301, 302, 307, 308) and r.headers["location"] == "/ui/"
    r = client.get("/ui?token=abc", follow_redirects=False)
    assert r.headers["location"] == "/ui/?token=abc"
    r = client.get("/ui/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == UI_CSP
    assert "app.js" in r.text
    r = client.get("/ui/app.js")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    for bad in (
        "/ui/../service/events/hub.py",
        "/ui/%2e%2e%2fpyproject.toml",
        "/ui/src",
        "/ui/nope.js",
    ):
        assert client.get(bad).status_code == 404, bad
