"""The sizes ``headroom serve`` reports mean what the plan's do, through the real server
(the default model on a simulated 2 GiB card, so a plan is fitted):

- the KV pool's bytes, wherever a key names them (``engine.info.kv_cache_bytes``, the
  plan's and the ``replan`` event's ``kv_pool_bytes``), are its usable pages' (the plan
  counts them so; the others counted the buffers, null page included), at start and
  after a live resize; the buffers' total has its own key, ``kv_buffer_bytes``;
- ``engine.info.weight_bytes`` is the plan's weights line, the float32 RoPE cache
  included (it was left out: 2 MiB less on the default model).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from service_harness import ServerProcess, serving, wait_for

CARD = ["--device-total", "2GiB", "--vram-source", "simulated", "--max-model-len", "2048",
        "--max-running-requests", "8"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(tmp_path_factory.mktemp("sizes"), CARD))


def _status(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/api/status", timeout=30).json()


def test_the_kv_pools_bytes_are_its_usable_pages_wherever_a_key_names_them(server):
    status = _status(server)
    info, plan = status["engine"]["info"], status["plan"]["plan"]
    page = info["page_size"] * info["kv_bytes_per_token"]
    pages = info["num_pages"]
    assert pages == plan["num_pages"] > 0, (info, plan)
    assert info["kv_cache_bytes"] == plan["kv_pool_bytes"] == pages * page, (info, plan)
    assert info["kv_buffer_bytes"] == (pages + 1) * page  # the null page's buffer too

    r = httpx.post(f"{server.base_url}/api/control/cache", json={"kv_cache": "256MiB"}, timeout=120,
                   headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 202, r.text
    replan = wait_for(lambda: next((e for e in _status(server)["replans"] if e["action"] == "set_kv_cache"), None),
                      60, "the resize's replan event")
    before, after = replan["before"], replan["after"]
    assert before["kv_pool_bytes"] == pages * page, replan
    status = _status(server)
    info, plan = status["engine"]["info"], status["plan"]["plan"]
    assert after["num_pages"] == info["num_pages"] == plan["num_pages"] < pages, (replan, info)
    assert after["kv_pool_bytes"] == info["kv_cache_bytes"] == plan["kv_pool_bytes"] == after["num_pages"] * page
    assert info["kv_buffer_bytes"] == (after["num_pages"] + 1) * page


def test_engine_info_weight_bytes_are_the_plans_weights(server):
    status = _status(server)
    weights = [e for e in status["plan"]["plan"]["ledger"] if e["name"] == "weights"]
    assert len(weights) == 1, status["plan"]
    assert status["engine"]["info"]["weight_bytes"] == weights[0]["bytes"], (status["engine"]["info"], weights)
