"""Client-facing scenarios against a real ``headroom serve`` (default model): a prompt
larger than the KV pool (and the service serving on after it), the stream's format
and usage, UTF-8 split across tokens, ``max_tokens`` edge values, broken bodies, a
client that goes away, origins and preflight, roles the chat template lacks. A killed
worker and a taken port are in test_service_restart.py."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_service_openai import QUESTION, sse_events

pytestmark = pytest.mark.slow


def chat(http: httpx.Client, **body) -> httpx.Response:
    body.setdefault("messages", QUESTION)
    return http.post("/v1/chat/completions", json=body)


def assert_openai_error(r: httpx.Response, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def engine_counters(http: httpx.Client) -> dict:
    stats = http.get("/api/status").json()["counters"]["engine"]
    assert stats is not None
    return stats


# -- a prompt larger than the pool -----------------------------------------------------


def test_f5_c06_prompt_over_context_is_refused_at_once_then_server_answers(real_server):
    with real_server.client() as http:
        context = http.get("/v1/models").json()["data"][0]["context_length"]
        # 256 pages of 16 tokens: the pool, not the model's 8192, is the limit.
        assert context <= 256 * 16
        long_text = "word " * (context + 200)
        started = time.monotonic()
        r = chat(http, messages=[{"role": "user", "content": long_text}], max_tokens=4)
        assert time.monotonic() - started < 10.0
        error = assert_openai_error(r, 400, code="context_length_exceeded")
        assert str(context) in error["message"]
        prompt_tokens = int(error["message"].split("your prompt is ")[1].split()[0])
        assert prompt_tokens > context

        # A prompt that fits but asks for more than the rest of the context.
        r = chat(http, max_tokens=context)
        error = assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")
        assert str(context) in error["message"]

        # The next normal request is served.
        r = chat(http, max_tokens=4, temperature=0)
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
        assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")


# -- stream format and usage ------------------------------------------------------------


def stream_events(http: httpx.Client, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(list(r.iter_lines()))


def test_c11_stream_chunk_format(real_server):
    with real_server.client() as http:
        events = stream_events(
            http, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 12, "temperature": 0}
        )
    assert events[-1] == "DONE"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_c12_usage_in_streams(real_server, path):
    body = {"max_tokens": 10, "temperature": 0}
    if path.endswith("chat/completions"):
        body["messages"] = QUESTION
    else:
        body["prompt"] = "Once upon a time"
    with real_server.client() as http:
        plain = http.post(path, json=body).json()
        with_usage = stream_events(http, path, {**body, "stream_options": {"include_usage": True}})
        without = stream_events(http, path, body)
    assert with_usage[-1] == "DONE"
    usage_chunks = [c for c in with_usage[:-1] if c.get("usage")]
    assert len(usage_chunks) == 1
    assert with_usage[-2] is usage_chunks[0]
    assert usage_chunks[0]["choices"] == []
    assert usage_chunks[0]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in with_usage[:-2])
    assert all("usage" not in c for c in without[:-1])


# -- split UTF-8 ------------------------------------------------------------------------------


def test_c14_split_utf8_never_shows_replacement_char(real_server):
    # Each 🎉 is three byte tokens for this tokenizer; greedy continues the pattern.
    body = {"prompt": "🎉🎉🎉🎉🎉🎉", "max_tokens": 13, "temperature": 0}
    with real_server.client() as http:
        plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        events = stream_events(http, "/v1/completions", body)
        pieces = [c["choices"][0]["text"] for c in events[:-1] if c["choices"]]
        chat_events = stream_events(
            http,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "日本語の文章：東京は日本の首都です。"}],
                "max_tokens": 20,
                "temperature": 0,
            },
        )
    assert "🎉" in plain
    assert "\ufffd" not in plain
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == plain
    chat_pieces = [c["choices"][0]["delta"].get("content", "") for c in chat_events[:-1]]
    assert all("\ufffd" not in p for p in chat_pieces)


# -- max_tokens edge values ---------------------------------------------------------------------


def test_c15_max_tokens_edges(real_server):
    with real_server.client() as http:
        # null: up to the rest of the context; the model stops by itself here.
        r = chat(http, max_tokens=None, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        # negative: 400 naming the field (both spellings).
        assert_openai_error(chat(http, max_tokens=-1), 400, param="max_tokens")
        assert_openai_error(
            chat(http, max_completion_tokens=-5), 400, param="max_completion_tokens"
        )
        # 0: an empty completion, documented; never a 500, the engine untouched.
        before = engine_counters(http)
        zero = chat(http, max_tokens=0)
        assert zero.status_code == 200, zero.text
        body = zero.json()
        assert body["choices"][0]["message"]["content"] == ""
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens"] > 0
        events = stream_events(
            http, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 0}
        )
        assert events[-1] == "DONE"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        after = engine_counters(http)
        assert after["finished"] == before["finished"]
        # max_completion_tokens wins over max_tokens.
        r = chat(http, max_tokens=2, max_completion_tokens=5, temperature=0, ignore_eos=True)
        assert r.json()["usage"]["completion_tokens"] == 5
        # Not an integer.
        assert_openai_error(chat(http, max_tokens="ten"), 400, param="max_tokens")


# -- broken bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"   ", None),
        (b"[1, 2, 3]", None),
        (b'"a string"', None),
        (b'{"messages": []}', "messages"),
        (b"{}", "messages"),
        (b'{"messages": "hello"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 9}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', "n"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30}', "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}', "tools[0].function"),
    ],
)
def test_c16_broken_bodies_get_openai_400(real_server, content, param):
    with real_server.client() as http:
        before = engine_counters(http)
        r = http.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        assert_openai_error(r, 400, param=param)
        after = engine_counters(http)
    assert after == before  # the engine never saw it


def test_c16_routes_and_models_errors(real_server):
    with real_server.client() as http:
        assert_openai_error(http.get("/v1/nothing-here"), 404)
        assert_openai_error(http.get("/v1/chat/completions"), 405)
        assert_openai_error(
            chat(http, model="gpt-4o", max_tokens=2), 404, param="model", code="model_not_found"
        )
        assert_openai_error(http.post("/v1/completions", json={"prompt": []}), 400, param="prompt")
        assert_openai_error(http.post("/v1/completions", json={"prompt": [[1, 2], "x"]}), 400)
        r = http.post("/v1/completions", json={"prompt": [1, 2, 99999999], "max_tokens": 1})
        assert_openai_error(r, 400, param="prompt")


# -- client goes away -----------------------------------------------------------------------------


def wait_idle(http: httpx.Client, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_counters(http)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# Generous deadlines on a busy machine: LONG runs for minutes unless it is aborted, and
# the aborted counter tells an abort from a request that finished.
ABORT_WITHIN_S = 60.0
IDLE_WITHIN_S = 60.0
LONG = {
    "messages": [{"role": "user", "content": "Count from one to one thousand."}],
    "max_tokens": 3000,
    "ignore_eos": True,
    "temperature": 0,
}


def test_c17_streaming_client_disconnect_aborts(real_server):
    with real_server.client() as http:
        before = wait_idle(http, IDLE_WITHIN_S)
        with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            # Keep the iterator referenced: dropping it mid-stream closes the connection.
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 5:
                    break
            assert engine_counters(http)["running"] == 1
        # The response is closed: the connection is gone. The abort lands between two
        # engine steps (tens of ms here; the bound leaves room for a loaded CI machine).
        after = wait_idle(http, ABORT_WITHIN_S)
    assert after["aborted"] == before["aborted"] + 1
    assert (
        after["free_pages"] + after["cached_pages"] >= before["free_pages"] + before["cached_pages"]
    )


def test_c17_non_streaming_client_disconnect_aborts(real_server):
    with real_server.client() as http:
        before = wait_idle(http, IDLE_WITHIN_S)
        # A raw connection, closed by the test once the engine runs the request (a
        # client-side timeout could fire before the engine has even started it).
        body = json.dumps(LONG).encode()
        conn = socket.create_connection(("127.0.0.1", real_server.port), timeout=60)
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + IDLE_WITHIN_S
        while engine_counters(http)["running"] == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.05)
        conn.close()  # the client goes away mid-answer
        after = wait_idle(http, ABORT_WITHIN_S)
    assert after["aborted"] == before["aborted"] + 1


# -- origins and preflight ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "origin",
    [
        "tauri://localhost",
        "http://tauri.localhost",
        "https://tauri.localhost",
        "http://localhost:1420",
    ],
)
def test_c19_tauri_origins_echoed(real_server, origin):
    r = httpx.get(real_server.base_url + "/v1/models", headers={"Origin": origin})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin


def test_c19_unknown_origin_refused(real_server):
    r = httpx.post(
        real_server.base_url + "/v1/chat/completions",
        headers={"Origin": "https://evil.example"},
        json={"messages": QUESTION, "max_tokens": 1},
    )
    assert_openai_error(r, 403)
    assert "access-control-allow-origin" not in r.headers


def test_c20_preflight_answered_without_reaching_a_handler(real_server):
    r = httpx.request(
        "OPTIONS",
        real_server.base_url + "/v1/chat/completions",
        headers={
            "Origin": "tauri://localhost",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization",
            "Access-Control-Request-Private-Network": "true",
            "Content-Type": "application/json",
        },
        content=b"{this is not json",
    )
    assert r.status_code == 204
    assert r.content == b""
    assert r.headers["access-control-allow-origin"] == "tauri://localhost"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert r.headers["access-control-allow-private-network"] == "true"
    # Without the private-network ask, no private-network header.
    r = httpx.request(
        "OPTIONS",
        real_server.base_url + "/v1/models",
        headers={"Origin": "http://tauri.localhost", "Access-Control-Request-Method": "GET"},
    )
    assert r.status_code == 204
    assert "access-control-allow-private-network" not in r.headers


def test_dns_rebinding_host_refused(real_server):
    r = httpx.get(real_server.base_url + "/v1/models", headers={"Host": "evil.example:8427"})
    assert_openai_error(r, 403)
    for host in ("localhost", f"127.0.0.1:{real_server.port}", f"[::1]:{real_server.port}"):
        assert (
            httpx.get(real_server.base_url + "/v1/models", headers={"Host": host}).status_code
            == 200
        )


def test_binds_loopback_only(real_server):
    assert socket.gethostbyname("localhost").startswith("127.")
    with real_server.client() as http:
        assert http.get("/api/health").status_code == 200
    # Nothing listens on the machine's other addresses.
    try:
        other = socket.gethostbyname(socket.gethostname())
    except OSError:
        pytest.skip("no other address")
    if other.startswith("127."):
        pytest.skip("the host name resolves to loopback")
    with pytest.raises((httpx.ConnectError, httpx.ConnectTimeout)):
        httpx.get(f"http://{other}:{real_server.port}/api/health", timeout=2)


# -- roles the template lacks -----------------------------------------------------------------------


def test_c22_developer_is_system_and_unknown_roles_refused(real_server, default_model_dir):
    from engine.text.chat import render_chat
    from service.api.text import load_tokenizer

    def ask(role: str) -> dict:
        with real_server.client() as http:
            r = chat(
                http,
                messages=[
                    {"role": role, "content": "Answer in one word."},
                    {"role": "user", "content": "What is the capital of France?"},
                ],
                max_tokens=8,
                temperature=0,
            )
        assert r.status_code == 200, r.text
        return r.json()

    as_system, as_developer = ask("system"), ask("developer")
    assert as_developer["usage"] == as_system["usage"]
    assert as_developer["choices"][0]["message"] == as_system["choices"][0]["message"]

    with real_server.client() as http:
        # a tool message here answers no call: OpenAI's history rule refuses the message
        for i, role, param in ((0, "wizard", "messages[0].role"), (1, "tool", "messages[1]")):
            messages = [{"role": "user", "content": "hi"}]
            messages.insert(i, {"role": role, "content": "x", "tool_call_id": "c1"})
            error = assert_openai_error(chat(http, messages=messages), 400, param=param)
            assert role in error["message"]
        assert_openai_error(
            chat(http, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            400,
            param="messages[0].content[0]",
        )

    tokenizer = load_tokenizer(default_model_dir)
    prompt = render_chat(tokenizer, QUESTION)
    assert prompt.endswith("<|im_start|>assistant\n")
    with real_server.client() as http:
        usage = chat(http, max_tokens=1).json()["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
