"""Ollama's unload (``keep_alive`` 0, alone or on a generation) beside other clients' generations, on a real
``headroom serve`` with the default model: the unload waits for what runs, the load
after it is reported as ``load_duration``, and a generation an unload ends carries
Retry-After."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from service_harness import ServerProcess, serving, wait_for

from service.api.engine_errors import failure
from service.common.engine_states import ENGINE_PAUSED
from service.supervision.inflight import EngineFailure

UNLOAD = {"model": "default", "messages": [], "keep_alive": "0s"}
HI = [{"role": "user", "content": "Count from one to three hundred in words."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    yield from serving(ServerProcess(tmp_path_factory.mktemp("unload")))


def _status(server) -> str:
    return server.health().json()["status"]


def _answers(server) -> bool:
    try:
        return bool(server.health())
    except httpx.HTTPError:
        return False


class _Stream(threading.Thread):
    """One streamed call read to its end: its lines, and an event at its first one."""

    def __init__(self, server, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.path, self.body = server, path, body
        self.started = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", self.server.base_url + self.path, json=self.body, timeout=600) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.strip():
                    self.lines.append(line)
                    self.started.set()
        self.started.set()


@pytest.mark.slow
def test_an_unload_waits_for_the_generations_in_flight(server):
    chat = _Stream(server, "/v1/chat/completions", {
        "messages": HI, "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True,
    })
    generate = _Stream(server, "/api/generate", {
        "model": "default", "prompt": HI[0]["content"], "options": {"num_predict": 300, "temperature": 0},
    })
    for stream in (chat, generate):
        stream.start()
        assert stream.started.wait(300), stream.path
    r = httpx.post(server.base_url + "/api/chat", json=UNLOAD, timeout=600)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    chat.join(600)
    generate.join(600)
    assert chat.status == 200 and chat.lines[-1] == "data: [DONE]", chat.lines[-3:]
    finished = [json.loads(x[len("data: "):]) for x in chat.lines[:-1]]
    assert not any("error" in x for x in finished), finished[-2:]
    assert finished[-1]["choices"][0]["finish_reason"] == "length", finished[-1]
    last = json.loads(generate.lines[-1])
    assert generate.status == 200 and last.get("done") is True and "error" not in last, last
    wait_for(lambda: _status(server) == "idle", 60, "unloaded once the generations finished")


@pytest.mark.slow
def test_load_duration_is_the_wait_for_the_model(server):
    r = httpx.post(server.base_url + "/api/chat", json=UNLOAD, timeout=600)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    wait_for(lambda: _status(server) == "idle", 60, "unloaded")
    ask = {"model": "default", "messages": HI, "stream": False, "options": {"num_predict": 2}}
    loading = httpx.post(server.base_url + "/api/chat", json=ask, timeout=600).json()
    loaded = httpx.post(server.base_url + "/api/chat", json=ask, timeout=600).json()
    assert loading["load_duration"] > loaded["load_duration"] >= 0, (loading, loaded)
    for answer in (loading, loaded):
        parts = answer["load_duration"] + answer["prompt_eval_duration"] + answer["eval_duration"]
        assert parts <= answer["total_duration"], answer


@pytest.mark.slow
def test_an_unload_waits_for_a_request_that_waits_for_the_load(server):
    """A request that woke the idle model and waits for its load was not counted: an
    unload sent meanwhile stopped the loading worker and the request got 503
    engine_idle ("the next request loads it again", though it was that request)."""
    r = httpx.post(server.base_url + "/api/chat", json=UNLOAD, timeout=600)
    assert r.status_code == 200, r.text
    wait_for(lambda: _status(server) == "idle", 60, "unloaded")
    waiting = _Stream(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "temperature": 0})
    waiting.start()
    wait_for(lambda: _status(server) == "starting", 60, "the load the request asked for")
    r = httpx.post(server.base_url + "/api/chat", json=UNLOAD, timeout=600)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    waiting.join(600)
    answer = json.loads(waiting.lines[0])
    assert waiting.status == 200 and answer["choices"][0]["message"]["content"], answer
    wait_for(lambda: _status(server) == "idle", 60, "unloaded after the answer")


@pytest.mark.slow
def test_a_prompt_still_being_cut_is_not_idle_time(tmp_path, default_model_dir):
    """--keep-alive 0 unloaded the model while a long /api prompt was cut to num_ctx,
    and the request then failed 503 engine_idle, again on every retry."""
    huge = {"model": "default", "stream": False, "options": {"num_ctx": 256, "num_predict": 3},
            "messages": [{"role": "user", "content": "word " * 400_000}]}
    server = ServerProcess(tmp_path, ["--keep-alive", "0"])
    try:
        wait_for(lambda: _answers(server) and _status(server) == "idle", 300, "loaded, then idle")
        r = httpx.post(server.base_url + "/api/chat", json=huge, timeout=600)
        assert r.status_code == 200 and r.json()["done"] is True, r.text
        wait_for(lambda: _status(server) == "idle", 60, "unloaded once it answered")
    finally:
        server.stop()


def test_a_generation_an_unload_ends_carries_retry_after():
    error = failure(EngineFailure(ENGINE_PAUSED, "the engine was unloaded (idle); retry"), 7)
    assert error.status == 503 and error.code == ENGINE_PAUSED
    assert error.headers == {"Retry-After": "7"}


@pytest.mark.slow
def test_keep_alive_0_on_a_generation_unloads_after_its_answer(server):
    chat = {"model": "default", "messages": HI, "stream": False, "keep_alive": 0, "options": {"num_predict": 3}}
    r = httpx.post(server.base_url + "/api/chat", json=chat, timeout=600)
    assert r.status_code == 200 and r.json()["message"]["content"], r.text
    wait_for(lambda: _status(server) == "idle", 60, "unloaded after the chat's answer")
    generate = _Stream(server, "/api/generate", {
        "model": "default", "prompt": HI[0]["content"], "keep_alive": "0s", "options": {"num_predict": 3},
    })
    generate.run()
    last = json.loads(generate.lines[-1])
    assert generate.status == 200 and last["done"] is True and "error" not in last, generate.lines
    wait_for(lambda: _status(server) == "idle", 60, "unloaded after the streamed generate")


@pytest.mark.slow
def test_keep_alive_0_on_a_generation_waits_for_the_others_in_flight(server):
    long = _Stream(server, "/v1/chat/completions", {
        "messages": HI, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True,
    })
    long.start()
    assert long.started.wait(300)
    short = {"model": "default", "prompt": "Hi", "stream": False, "keep_alive": "0", "options": {"num_predict": 2}}
    r = httpx.post(server.base_url + "/api/generate", json=short, timeout=600)
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    long.join(600)
    finished = [json.loads(x[len("data: "):]) for x in long.lines[:-1]]
    assert not any("error" in x for x in finished), finished[-2:]
    assert finished[-1]["choices"][0]["finish_reason"] == "length", finished[-1]
    wait_for(lambda: _status(server) == "idle", 60, "unloaded once the other generation finished")


@pytest.mark.slow
@pytest.mark.parametrize("keep_alive", [{"keep_alive": "5m"}, {}])
def test_a_request_started_after_a_keep_alive_0_one_keeps_the_model_loaded(server, keep_alive):
    """As in Ollama the latest request's keep_alive is the model's: a generation with
    keep_alive 0 unloaded after its answer even when a request started after it asked
    for 5m (or left it unset: Ollama's default, 5m); its pending unload is dropped."""
    httpx.post(server.base_url + "/api/chat", json={"model": "default", "messages": []}, timeout=600)  # loaded
    dropped = server.log().count("a keep_alive 0 unload was dropped")
    first = _Stream(server, "/api/generate", {
        "model": "default", "prompt": HI[0]["content"], "keep_alive": 0, "options": {"num_predict": 200},
    })
    first.start()
    assert first.started.wait(300)
    later = {"model": "default", "messages": HI, "stream": False, "options": {"num_predict": 2}, **keep_alive}
    r = httpx.post(server.base_url + "/api/chat", json=later, timeout=600)
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    first.join(600)
    last = json.loads(first.lines[-1])
    assert first.status == 200 and last["done"] is True and "error" not in last, first.lines[-2:]
    # Either outcome is awaited: the unload dropped (logged) or done (idle).
    wait_for(lambda: server.log().count("a keep_alive 0 unload was dropped") > dropped or _status(server) == "idle",
             60, "the keep_alive 0 unload dropped or done")
    assert _status(server) == "ready"
