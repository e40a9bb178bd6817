"""A new user's finds in the control API of ``headroom serve`` on the CPU (the default
model, one server for the module, started with switches that do not apply to it):

- ``--expert-cpu-share auto`` on a dense model on the CPU, with bus reads off, is taken
  and said once at start to do nothing here, naming every reason;
- an expert cache size on a dense model is a 409 naming the field and that the model has
  no mixture-of-experts layers, not a 501 pointing at ``--cpu-experts``;
- while paused, no KV pages are reported in use or held: ``/metrics`` has no pool series,
  ``/api/status`` has ``engine.info.num_pages`` 0 and ``counters.engine`` null;
- a live KV cache size is kept across a pause and a resume, and the resume says so;
  its answer prices the usable pages, as ``headroom plan`` does (not the buffers, whose
  null page made 512 MiB read "513 MiB");
- after a restart with a kept size, ``{"kv_cache": null}`` gives the start's pool back
  (the worker took the kept size as its start size: "the KV pool stays at N pages");
- a live grow leaves the host's margin free, as the start's check does (its most was
  all of ``MemAvailable``);
- a split count on the CPU is a 409 whatever the count (-1 was a 400 naming a range in
  which every value is a 409); a body on pause, resume or restart is a 400 (``garbage``
  and ``{"bogus": 1}`` were taken).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from service_harness import ServerProcess, serving, wait_for

from engine.common.units import MiB, fmt_bytes
from engine.memory.host_room import host_room


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(tmp_path_factory.mktemp("paused"),
                                     ["--expert-cpu-share", "auto", "--no-expert-bus-reads"]))


def _post(server: ServerProcess, action: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/control/{action}", json=body,
                      headers={"Authorization": f"Bearer {server.token}"}, timeout=120)


def _status(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/api/status", timeout=30).json()


def test_expert_cpu_share_auto_where_it_does_nothing_is_said_once_at_start(server):
    lines = [line for line in server.log().splitlines() if "--expert-cpu-share auto does nothing here" in line]
    assert len(lines) == 1, server.log()
    assert "not CUDA" in lines[0] and "no mixture-of-experts layer" in lines[0], lines[0]
    assert "--no-expert-bus-reads" in lines[0], lines[0]


def test_an_expert_cache_on_a_dense_model_is_refused_naming_the_field(server):
    for size in ("1GiB", None):
        r = _post(server, "cache", {"expert_cache": size})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["param"] == "expert_cache" and error["code"] == "no_experts", r.text
        assert "this model has no mixture-of-experts layers" in error["message"], r.text
        assert "every routed expert is on the device" not in error["message"], r.text


def test_a_paused_engine_reports_no_pool_and_keeps_the_live_kv_size(server):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"prompt": "The history of computing " * 6, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    r = _post(server, "cache", {"kv_cache": "256MiB"})
    assert r.status_code == 202, r.text
    info = _status(server)["engine"]["info"]
    live = info["num_pages"]
    assert live > 0, live
    # The answer prices the usable pages, as `headroom plan --kv-cache 256MiB` does.
    priced = fmt_bytes(live * info["page_size"] * info["kv_bytes_per_token"])
    assert f"-> {live} pages (" in r.json()["message"] and f" -> {priced})" in r.json()["message"], r.text

    assert _post(server, "pause").status_code == 202
    wait_for(lambda: _status(server)["engine"]["info"]["num_pages"] == 0, 60, "the pool's pages gone")
    status = _status(server)
    assert status["engine"]["info"]["kv_cache_bytes"] == 0, status["engine"]
    assert status["counters"]["engine"] is None, status["counters"]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert "headroom_kv_pages" not in metrics, metrics
    assert 'headroom_engine_state{state="paused"} 1.0' in metrics

    r = _post(server, "resume")
    assert r.status_code == 202, r.text
    assert f"KV pool at the size set live ({live} pages" in r.json()["message"], r.text
    server.wait_ready()
    wait_for(lambda: (_status(server)["counters"] or {}).get("engine") is not None, 60, "the new worker's counters")
    status = _status(server)
    assert status["engine"]["info"]["num_pages"] == live == status["counters"]["engine"]["total_pages"], status

    # Back to the start's size: the next worker starts with it too.
    r = _post(server, "cache", {"kv_cache": None})
    assert r.status_code == 202, r.text
    r = _post(server, "restart")
    assert r.status_code == 202 and "the KV pool sized as at start" in r.json()["message"], r.text


def test_null_after_a_restart_with_a_kept_size_gives_the_start_pool_back(server):
    server.wait_ready()
    wait_for(lambda: (_status(server)["counters"] or {}).get("engine") is not None, 60, "the worker's counters")
    start = _status(server)["engine"]["info"]["num_pages"]
    assert _post(server, "cache", {"kv_cache": "256MiB"}).status_code == 202
    kept = _status(server)["engine"]["info"]["num_pages"]
    assert kept < start
    r = _post(server, "restart")
    assert r.status_code == 202 and f"the size set live ({kept} pages" in r.json()["message"], r.text
    server.wait_ready()
    wait_for(lambda: (_status(server)["counters"] or {}).get("engine") is not None, 60, "the new worker's counters")
    assert _status(server)["engine"]["info"]["num_pages"] == kept
    # The new worker knows its start pool apart from the kept one: null gives it back.
    r = _post(server, "cache", {"kv_cache": None})
    assert r.status_code == 202 and f"{kept} -> {start} pages" in r.json()["message"], r.text
    assert _status(server)["engine"]["info"]["num_pages"] == start


def test_a_grow_leaves_the_hosts_margin_free(server):
    room = host_room()
    have = room.total if room.available is None else room.available
    r = _post(server, "cache", {"kv_cache": f"{(have - 64 * MiB) // MiB}MiB"})  # within MemAvailable, not its margin
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_room", r.text
    assert "kept free for a step's activations" in r.json()["error"]["message"], r.text


def test_a_split_on_the_cpu_is_refused_for_any_count_and_bodies_on_bodiless_actions(server):
    for count in (-1, 3, 10_000):
        r = _post(server, "cache", {"cpu_layers": count})
        assert r.status_code == 409 and r.json()["error"]["code"] == "split_fixed", r.text
    headers = {"Authorization": f"Bearer {server.token}"}
    for action in ("pause", "resume", "restart"):
        for body in (b"garbage", b'{"bogus": 1}', b"[]"):
            r = httpx.post(f"{server.base_url}/api/control/{action}", content=body, headers=headers, timeout=30)
            assert r.status_code == 400, (action, body, r.text)
            assert f"the control action {action} takes no body" in r.json()["error"]["message"], r.text
    r = _post(server, "resume", {})  # {} is no body
    assert r.status_code == 202 and "nothing to resume" in r.json()["message"], r.text
