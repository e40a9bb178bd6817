"""The control API on an engine that runs on the CPU with no card beside it (a new
user's finds): every decoder layer runs on the CPU already, so a split move is refused,
naming why, where it was taken and logged as device memory given back; the smallest KV
cache it takes is one request of ``--min-context`` (2,048 tokens), the floor
``--kv-cache`` has at start, not the model's whole context."""

from __future__ import annotations

import httpx


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
