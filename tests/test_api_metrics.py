"""``GET /metrics`` and ``HEAD`` on every ``GET`` route, on a real ``headroom serve``
with the default model: the text parsed by ``prometheus_client``'s own parser after
real calls through the official clients, and each figure checked to have moved."""

from __future__ import annotations

import os

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` by name and labels."""
    r = httpx.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.slow
def test_metrics_move_with_calls(real_server):
    before = scrape(real_server)
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    ollama.Client(host=real_server.base_url, timeout=600).chat(
        model="default", messages=QUESTION, options={"num_predict": 4}, stream=False
    )
    bad = httpx.post(real_server.base_url + "/v1/chat/completions", json={"model": "default"}, timeout=30)
    assert bad.status_code == 400
    after = scrape(real_server)

    chat = "/v1/chat/completions"
    assert value(after, "headroom_requests_total", route=chat, outcome="200") - value(
        before, "headroom_requests_total", route=chat, outcome="200"
    ) == 2
    assert value(after, "headroom_requests_total", route=chat, outcome="400") - value(
        before, "headroom_requests_total", route=chat, outcome="400"
    ) == 1
    assert value(after, "headroom_requests_total", route="/api/chat", outcome="200") >= 1
    generated = value(after, "headroom_generation_tokens_total", route=chat) - value(
        before, "headroom_generation_tokens_total", route=chat
    )
    assert generated == 2 * reply.usage.completion_tokens
    assert value(after, "headroom_prompt_tokens_total", route=chat) - value(
        before, "headroom_prompt_tokens_total", route=chat
    ) == 2 * reply.usage.prompt_tokens
    assert value(after, "headroom_time_to_first_token_seconds_count", route=chat) - value(
        before, "headroom_time_to_first_token_seconds_count", route=chat
    ) == 2
    assert value(after, "headroom_request_duration_seconds_count", route=chat) - value(
        before, "headroom_request_duration_seconds_count", route=chat
    ) == 2
    # Every token after a sequence's first is one gap.
    assert value(after, "headroom_inter_token_latency_seconds_count") - value(
        before, "headroom_inter_token_latency_seconds_count"
    ) >= 2 * (reply.usage.completion_tokens - 1)

    # Read at the scrape: the engine's state, pool and counters.
    assert value(after, "headroom_engine_state", state="ready") == 1
    assert value(after, "headroom_engine_state", state="failed") == 0
    total = value(after, "headroom_kv_pages_total")
    assert total > 0 and 0 <= value(after, "headroom_kv_pages_used") <= total
    assert value(after, "headroom_requests_running") == 0
    assert ("headroom_worker_restarts_total", ()) in after
    assert ("headroom_replans_total", ()) in after
    assert ("headroom_oom_steps_total", ()) in after
    finished = ("headroom_engine_sequences_ended_total", (("how", "finished"),))
    assert after[finished] - before.get(finished, 0) >= 3
    # The embedded model keeps every expert... it has none: no expert cache figures.
    assert not any(name.startswith("headroom_expert_cache") for name, _ in after)


def test_expert_cache_figures_only_with_an_expert_cache():
    from service_harness import engine_stats

    from service.events.metrics import Reading, ServiceMetrics

    def families(stats) -> set[str]:
        metrics = ServiceMetrics(lambda: Reading(state="ready", states=("ready", "idle"), restarts=1, calls_waiting=0,
                                                 sequences_in_flight=0, stats=stats))
        return {f.name for f in text_string_to_metric_families(metrics.exposition().decode())}

    with_cache = families(engine_stats(total_pages=10, free_pages=4, expert_cache_hits=5, expert_cache_slots=8))
    assert {"headroom_expert_cache_hits", "headroom_expert_cache_misses", "headroom_expert_cache_slots"} <= with_cache
    assert "headroom_expert_cache_hits" not in families(engine_stats(total_pages=10))
    # Before any worker reported: the service's own figures, none of the engine's.
    before = families(None)
    assert "headroom_worker_restarts" in before and "headroom_kv_pages_total" not in before


def _get_paths(app) -> list[str]:
    """Every ``GET`` route of the app, its path parameters filled in."""
    fill = {"{model_id:path}": "default", "{file_path:path}": "index.html", "{response_id:str}": "resp_1"}
    paths = []
    for route in app.routes:
        if "GET" in getattr(route, "methods", ()):
            path = route.path
            for param, value_ in fill.items():
                path = path.replace(param, value_)
            assert "{" not in path, f"fill in the parameter of {route.path}"
            paths.append(path)
    return paths


@pytest.mark.slow
def test_head_answers_like_get_on_every_get_route(real_server, monkeypatch, tmp_path):
    monkeypatch.setenv("HEADROOM_CONFIG_DIR", str(tmp_path))
    from service.common.settings_sources import resolve
    from service.http.app import create_app

    secured, _ = create_app(resolve({}, env={"HEADROOM_CONFIG": os.devnull}))
    paths = _get_paths(secured.app.app)
    assert {"/", "/metrics", "/api/tags", "/v1/models", "/api/health"} <= set(paths)
    with real_server.client() as http:
        for path in paths:
            got = http.get(path)
            head = http.head(path)
            assert head.status_code == got.status_code, path
            assert head.content == b"", path
            assert head.headers.get("content-type") == got.headers.get("content-type"), path
    # Ollama's client pings HEAD / and takes any status from 400 on as "not running".
    r = httpx.head(real_server.base_url + "/")
    assert r.status_code == 200 and r.headers["content-length"] == str(len("headroom is running"))
