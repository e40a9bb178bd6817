"""Ollama's load and unload calls (an empty ``/api/chat`` or ``/api/generate``, with and
without ``keep_alive`` 0) on a ``headroom serve`` with the fake engine: the shapes Ollama
answers with, the worker really stopped and loaded again, and the refusals of a bad
``keep_alive``."""

from __future__ import annotations

import httpx
import ollama
import pytest
from service_harness import wait_for

pytestmark = pytest.mark.slow

ZERO = [0, 0.0, "0", "0s", "0m", "0h", "0ms"]


def _status(server) -> str:
    return server.health().json()["status"]


def test_load_and_unload_as_ollama_does(start_server):
    server = start_server(fake=True)
    client = ollama.Client(host=server.base_url, timeout=120)
    loaded = client.chat(model="default", messages=[])
    assert loaded.done and loaded.done_reason == "load"
    assert loaded.message.role == "assistant" and loaded.message.content == ""
    for keep_alive in ZERO:
        r = httpx.post(server.base_url + "/api/chat", json={"model": "default", "messages": [], "keep_alive": keep_alive},
                       timeout=120)
        assert r.status_code == 200, (keep_alive, r.text)
        body = r.json()
        assert set(body) == {"model", "created_at", "message", "done_reason", "done"}
        assert body["message"] == {"role": "assistant", "content": ""}
        assert body["done"] is True and body["done_reason"] == "unload", keep_alive
        assert _status(server) == "idle"
        assert server.health().json()["worker_pid"] is None
        # The empty chat loads it again, and answers once it serves.
        (again,) = client.chat(model="default", messages=[], stream=True)
        assert again.done and again.done_reason == "load"
        assert _status(server) == "ready"
    # Through the official client's own keep_alive, and /api/generate's spelling.
    assert client.generate(model="default", keep_alive=0).done_reason == "unload"
    assert _status(server) == "idle"
    generated = client.generate(model="default")
    assert generated.done_reason == "load" and generated.response == ""
    assert _status(server) == "ready"
    # A nonzero keep_alive only loads.
    assert client.chat(model="default", messages=[], keep_alive="5m").done_reason == "load"


def test_ollama_refuses_what_it_refuses(start_server):
    server = start_server(fake=True)
    with server.client() as http:
        for bad in ["abc", "1d", "", True, [1], 10**400]:
            r = http.post("/api/chat", json={"model": "default", "messages": [], "keep_alive": bad})
            assert r.status_code == 400 and set(r.json()) == {"error"}, (bad, r.text)
            assert "keep_alive" in r.json()["error"]
        r = http.post("/api/generate", json={"model": "nope", "keep_alive": 0})
        assert r.status_code == 404 and "nope" in r.json()["error"]
        r = http.post("/api/chat", json={"model": "nope", "messages": []})
        assert r.status_code == 404 and set(r.json()) == {"error"}
    wait_for(lambda: _status(server) == "ready", 30, "still ready")
