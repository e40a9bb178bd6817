"""What a fresh user of the APIs met, each through a real ``headroom serve`` on the
embedded default model: a served name ending in ``:latest`` that Ollama's routes did
not take as /api/tags lists it."""

from __future__ import annotations

import httpx
import pytest
from service_harness import ServerProcess, serving

SERVED = "gpt-4:latest"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    yield from serving(ServerProcess(tmp_path_factory.mktemp("fresh-user"), ["--served-model-name", SERVED]))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


def _ollama_calls(model: str) -> dict[str, dict]:
    short = {"stream": False, "options": {"num_predict": 1}}
    return {
        "/api/chat": {"model": model, "messages": HI, **short},
        "/api/generate": {"model": model, "prompt": "Hi", **short},
        "/api/show": {"model": model},
    }


def test_every_name_the_listings_give_works_in_ollamas_calls(http):
    tags = [m["name"] for m in http.get("/api/tags").json()["models"]]
    listed = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert tags == [SERVED] and SERVED in listed, (tags, listed)
    # As Ollama: the name listed, without its tag :latest, and in any case.
    for model in (SERVED, "gpt-4", "GPT-4", "Gpt-4:LATEST", "default"):
        for path, body in _ollama_calls(model).items():
            r = http.post(path, json=body)
            assert r.status_code == 200, (path, model, r.text)
            if path != "/api/show":
                assert r.json()["model"] == SERVED, r.json()
        r = http.post("/api/chat", json={"model": model, "messages": []})
        assert r.status_code == 200 and r.json()["done_reason"] == "load", (model, r.text)


def test_a_name_with_a_second_tag_is_another_model(http):
    for path, body in _ollama_calls(SERVED + ":latest").items():
        r = http.post(path, json=body)
        assert r.status_code == 404, (path, r.text)
        assert "gpt-4:latest" in r.json()["error"], r.text
    r = http.post("/api/chat", json={"model": "gpt-4:q4", "messages": HI, "stream": False})
    assert r.status_code == 404, r.text
