"""Issue 15's live replan of the GPU expert cache, end to end through ``headroom serve``
on the CPU: a tiny Qwen3-MoE with its last MoE layer's routed experts in host memory
(``--cpu-experts 1``) on a simulated 4 GiB card. Another process takes a little memory:
the expert cache shrinks (the first replan; the KV pool keeps every page), requests in
flight finish with the same greedy output as with the whole cache, and once the memory
comes back the expert cache grows back to the plan.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from service_harness import wait_for

pytestmark = pytest.mark.slow

MiB = 1 << 20
PROMPT = "The expert cache of a mixture of experts"
MAX_TOKENS = 24
# Experts large enough that whole slots are MiB (16 of them in the one host layer), so
# the cache alone can give back what another process takes.
EXPERTS = dict(hidden_size=256, moe_intermediate_size=1024, num_experts=16, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    make_tiny_hf_model("qwen3_moe", folder, vocab_size=len(smollm_tokenizer), **EXPERTS)
    smollm_tokenizer.save_pretrained(folder)
    return str(folder)


def complete(base_url: str) -> tuple[float, float, str]:
    """One greedy completion of :data:`PROMPT`: (start, end, text); start and end are
    Unix seconds, as the events' ``ts``."""
    started = time.time()
    with httpx.Client(base_url=base_url, timeout=300) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return started, time.time(), r.json()["choices"][0]["text"]


class Clients:
    """``n`` threads completing :data:`PROMPT` one request after another until
    :meth:`stop`, which returns every ``(start, end, text)``."""

    def __init__(self, base_url: str, n: int) -> None:
        self.base_url = base_url
        self.results: list[tuple[float, float, str]] = []
        self.errors: list[BaseException] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.results.append(complete(self.base_url))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                return

    def stop(self) -> list[tuple[float, float, str]]:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=300)
        return self.results


@pytest.mark.timeout(1800)
def test_the_expert_cache_shrinks_before_the_pool_and_outputs_stay_equal(start_server, tiny_qwen3_moe, tmp_path):
    # The plan leaves its safety margin (128 MiB + 1% of the card, ~169 MiB) as headroom;
    # the band sits below it, so nothing moves until another process takes 55 MiB at
    # 3 s, which the expert cache alone gives back (the chunk cap is already at its floor
    # of 256 tokens); the process leaves at 12 s.
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"display": False, "steps": [[0, 0], [3, "55MiB"], [12, 0]]}))
    server = start_server([
        "--model", tiny_qwen3_moe, "--device", "cpu", "--cpu-experts", "1", "--device-total", "4GiB",
        "--max-model-len", "512", "--max-prefill-tokens", "256", "--max-running-requests", "4",
        "--vram-source", "simulated", "--vram-timeline", str(timeline), "--reserve", "0",
        "--replan-low", "120MiB", "--replan-high", "150MiB", "--replan-hold", "1",
    ])
    clients = Clients(server.base_url, 3)
    http = server.client()
    try:
        status = http.get("/api/status").json()
        plan = status["plan"]["plan"]
        planned_slots, planned_pages = plan["expert_cache_slots"], status["engine"]["info"]["num_pages"]
        assert plan["cpu_expert_layers"] == 1 and planned_slots == EXPERTS["num_experts"], plan

        def replans() -> list[dict]:
            return http.get("/api/status").json()["replans"]

        shrink = wait_for(lambda: next((r for r in replans() if r["action"] == "shrink_expert_cache"), None),
                          300, "the expert cache to shrink")
        grow = wait_for(lambda: next((r for r in replans() if r["action"] == "grow_expert_cache"), None),
                        300, "the expert cache to grow back")
        # Requests that straddle both changes, then a last one with the whole cache.
        wait_for(lambda: any(end > grow["ts"] for _, end, _ in clients.results), 300, "a request after the grow")
        results = clients.stop()
        assert not clients.errors, clients.errors
        reference = complete(server.base_url)[2]
        final = http.get("/api/status").json()
    finally:
        clients.stop()
        http.close()

    # The first replan was the expert cache's, and it alone gave the memory back: the
    # KV pool kept every page, before and after.
    actions = [r["action"] for r in final["replans"]]
    assert actions[0] == "shrink_expert_cache", actions
    assert not {"shrink_kv", "grow_kv", "lower_chunk_cap", "evict_prefix_cache"} & set(actions), actions
    assert shrink["before"]["expert_cache_slots"] == planned_slots
    assert 0 <= shrink["after"]["expert_cache_slots"] < planned_slots
    assert shrink["after"]["expert_cache_bytes"] < shrink["before"]["expert_cache_bytes"]
    assert shrink["before"]["num_pages"] == shrink["after"]["num_pages"] == planned_pages
    assert "below the low water mark" in shrink["reason"]
    assert grow["after"]["expert_cache_slots"] == planned_slots
    assert final["engine"]["info"]["num_pages"] == planned_pages
    assert final["counters"]["engine"]["expert_cache_slots"] == planned_slots
    # Requests in flight across the shrink finished, with the whole cache's greedy text.
    across = [r for r in results if r[0] < shrink["ts"] < r[1]]
    assert across, f"no request was in flight at the shrink ({len(results)} requests)"
    assert {text for _, _, text in results} == {reference}, results
    print(f"expert cache {planned_slots} -> {shrink['after']['expert_cache_slots']} -> "
          f"{grow['after']['expert_cache_slots']} slots; {len(results)} requests ({len(across)} across the "
          "shrink), all equal; KV pool untouched")
