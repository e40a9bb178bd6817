"""The control API on an engine that runs on the CPU with no card beside it (a new
user's finds): every decoder layer runs on the CPU already, so a split move is refused,
naming why, where it was taken and logged as device memory given back; the smallest KV
cache it takes is one request of ``--min-context`` (2,048 tokens), the floor
``--kv-cache`` has at start, not the model's whole context; a path under
``/api/control`` that no route serves is the control API's 404, naming its routes, as
other unknown paths answer in their own API's shape; the KV pool's pages are one count
(usable pages) on every surface; clearing the prefix cache logs the evicted pages'
keys and values, not the pool's bytes."""

from __future__ import annotations

import re

import httpx

from engine.common.units import fmt_bytes


def test_a_split_move_on_a_cpu_engine_is_refused_naming_why(real_server):
    headers = {"Authorization": f"Bearer {real_server.token}"}
    before = httpx.get(f"{real_server.base_url}/api/status", timeout=30).json()
    for body in ({"cpu_layers": 3}, {"cpu_layers": None}):
        r = httpx.post(f"{real_server.base_url}/api/control/cache", json=body, headers=headers, timeout=60)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "split_fixed" and error["param"] == "cpu_layers"
        assert "runs on the CPU: every decoder layer runs there already" in error["message"]
    after = httpx.get(f"{real_server.base_url}/api/status", timeout=30).json()
    assert after["engine"]["info"]["num_pages"] == before["engine"]["info"]["num_pages"]
    assert "moved to the CPU" not in real_server.log()


def test_the_smallest_kv_cache_is_one_request_of_the_min_context(real_server):
    headers = {"Authorization": f"Bearer {real_server.token}"}
    r = httpx.post(f"{real_server.base_url}/api/control/cache", json={"kv_cache": "1MiB"}, headers=headers,
                   timeout=60)
    assert r.status_code == 400, r.text
    assert "the smallest is 128 pages" in r.json()["error"]["message"], r.text  # 2,048 tokens of 16


def test_a_kv_cache_size_is_read_as_the_cli_reads_it(real_server):
    """The control API's sizes go through the CLI's one parser: 1 is 1 byte (it was "a
    KV cache of 0 KiB"), an exbibyte is beyond any machine, a full-width digit is no
    size (it was read as 1 GiB)."""
    headers = {"Authorization": f"Bearer {real_server.token}"}

    def refusal(size):
        r = httpx.post(f"{real_server.base_url}/api/control/cache", json={"kv_cache": size}, headers=headers,
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_cache", r.text
        return r.json()["error"]["message"]

    assert refusal(1).startswith("a KV cache of 1 byte holds 0 pages; the smallest is 128 pages")
    assert refusal("1EiB").startswith("'1EiB' is more than 1 PiB")
    assert refusal("\uff11GiB").startswith("'\uff11GiB' is not a size")


def test_a_desktop_reserve_on_a_cpu_engine_is_refused_naming_why(real_server):
    headers = {"Authorization": f"Bearer {real_server.token}"}
    r = httpx.post(f"{real_server.base_url}/api/control/reserve", json={"reserve": "1PiB"}, headers=headers,
                   timeout=60)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "no_card" and error["param"] == "reserve"
    assert "runs on the CPU: GPU memory is watched, not replanned" in error["message"]


def _cached_pages(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("headroom_kv_pages_cached"))


def test_a_refused_size_leaves_the_prefix_cache_as_it_was(real_server):
    """Every field of a cache call is read before anything is done, and the prefix cache
    is cleared last: a size refused beside ``clear_prefix_cache`` clears nothing."""
    headers = {"Authorization": f"Bearer {real_server.token}"}
    r = httpx.post(f"{real_server.base_url}/v1/completions", timeout=120,
                   json={"prompt": "The history of computing " * 6, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    cached = _cached_pages(real_server)
    assert cached > 0
    for size, status in (("1MiB", 400), ("lots", 400), ("1PiB", 409)):
        r = httpx.post(f"{real_server.base_url}/api/control/cache", headers=headers, timeout=60,
                       json={"clear_prefix_cache": True, "kv_cache": size})
        assert r.status_code == status, r.text
        assert _cached_pages(real_server) == cached


def test_an_unknown_control_route_answers_in_the_control_apis_shape_naming_the_routes(real_server):
    """A path under ``/api/control`` no route serves was Ollama's ``{"error": "..."}``
    (any 404 under ``/api``); it is the control API's own error object, naming the
    routes there are. Unknown paths elsewhere keep their API's shape: Ollama's under
    ``/api``, OpenAI's under ``/v1``, Anthropic's under ``/v1/messages``."""
    headers = {"Authorization": f"Bearer {real_server.token}"}
    for method, path in (("POST", "/api/control/nonsense"), ("GET", "/api/control/x"), ("GET", "/api/control")):
        r = httpx.request(method, real_server.base_url + path, headers=headers, timeout=30)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["type"] == "not_found_error" and error["code"] == "unknown_control_route", r.text
        assert f"no control route {method} {path}:" in error["message"], r.text
        for action in ("restart", "pause", "resume", "reserve", "cache"):
            assert f"/api/control/{action}" in error["message"], r.text
    # A control route with the wrong method is the control API's 405.
    r = httpx.get(real_server.base_url + "/api/control/cache", headers=headers, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text

    r = httpx.post(real_server.base_url + "/api/nonsense", timeout=30)
    assert r.status_code == 404 and isinstance(r.json()["error"], str), r.text  # Ollama's shape
    r = httpx.post(real_server.base_url + "/v1/nonsense", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text  # OpenAI's
    r = httpx.post(real_server.base_url + "/v1/messages/nonsense", timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error", r.text  # Anthropic's
    assert r.json()["error"]["type"] == "not_found_error", r.text


def test_the_kv_pools_pages_are_one_count_on_every_surface(real_server):
    """``engine.info.num_pages`` in ``/api/status`` counted the null page (256 for
    ``--num-pages 256``) where the counters beside it, ``/metrics`` and the control API
    count the 255 pages requests can use; all say 255 now."""
    headers = {"Authorization": f"Bearer {real_server.token}"}
    status = httpx.get(f"{real_server.base_url}/api/status", timeout=30).json()
    pages = status["engine"]["info"]["num_pages"]
    assert pages == status["counters"]["engine"]["total_pages"] == 255, status["engine"]
    metrics = httpx.get(f"{real_server.base_url}/metrics", timeout=30).text
    assert f"headroom_kv_pages_total {pages}" in metrics
    # Back to the plan's size, which --num-pages fixed: nothing changes, and the answer
    # names the pool by the same count.
    r = httpx.post(f"{real_server.base_url}/api/control/cache", json={"kv_cache": None}, headers=headers, timeout=60)
    assert r.status_code == 202, r.text
    assert f"the KV pool stays at {pages} pages" in r.json()["message"], r.text


def test_clearing_the_prefix_cache_logs_what_the_evicted_pages_held(real_server):
    """The log named the whole pool's bytes (1 GiB for 127 pages): it names the evicted
    pages' keys and values, as ``engine.info`` prices a page."""
    headers = {"Authorization": f"Bearer {real_server.token}"}
    r = httpx.post(f"{real_server.base_url}/v1/completions", timeout=120,
                   json={"prompt": "A short history of the telescope " * 8, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    info = httpx.get(f"{real_server.base_url}/api/status", timeout=30).json()["engine"]["info"]
    page_bytes = info["page_size"] * info["kv_bytes_per_token"]
    r = httpx.post(f"{real_server.base_url}/api/control/cache", json={"clear_prefix_cache": True}, headers=headers,
                   timeout=60)
    assert r.status_code == 202, r.text
    found = re.findall(r"prefix cache: (\d+) pages evicted, ([\d.]+ \w+) of keys and values", real_server.log())
    assert found, real_server.log()
    pages, held = found[-1]
    assert held == fmt_bytes(int(pages) * page_bytes), (found, page_bytes)
