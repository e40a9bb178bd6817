"""What a new user of the HTTP APIs met, each through a real ``headroom serve`` on the
embedded default model (a 512-token context, so a prompt past it is cheap): Responses'
``truncation: "auto"`` ignored; its input checks unlike chat completions' (an empty
content list, ``input: ""``, an assistant ``refusal`` part, ``stream_options`` without
``stream``; a message item's role that is no string a 500, its fields' codes unlike
docs/api.md's); ``include`` and ``metadata`` taken unchecked; ``temperature``/``top_p``
echoed null when unset; stored-response routes and unknown paths answering a 404 without a ``code``; the 501s of the embeddings routes
left out of ``/metrics``; Ollama's greedy ``top_p`` 0 and negative ``temperature``
refused; the OpenAPI document without pause and resume."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from service_harness import ServerProcess, serving
from test_api_metrics import scrape, value

CONTEXT = 512
LONG = "word " * 700  # past the context alone


@pytest.fixture(scope="module")
def http(tmp_path_factory, default_model_dir):
    server = ServerProcess(tmp_path_factory.mktemp("responses-user"), ["--max-model-len", str(CONTEXT)])
    for ready in serving(server):
        with httpx.Client(base_url=ready.base_url, timeout=300) as client:
            yield client


def _refused(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_truncation_auto_drops_the_oldest_items_and_keeps_the_instructions(http):
    tail = [{"role": "assistant", "content": "OK."}, {"role": "user", "content": "Say hi."}]
    body = {"instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0}
    long_input = [{"role": "user", "content": LONG}, *tail]
    _refused(http.post("/v1/responses", json={**body, "input": long_input}), 400, "input", "context_length_exceeded")
    _refused(http.post("/v1/responses", json={**body, "input": long_input, "truncation": "disabled"}),
             400, "input", "context_length_exceeded")
    _refused(http.post("/v1/responses", json={**body, "input": "Hi", "truncation": "sometimes"}), 400, "truncation")

    cut = http.post("/v1/responses", json={**body, "input": long_input, "truncation": "auto"})
    assert cut.status_code == 200, cut.text
    short = http.post("/v1/responses", json={**body, "input": tail, "truncation": "auto"})
    assert short.status_code == 200, short.text
    # The long first item went, the instructions and the last two items stayed.
    assert cut.json()["usage"]["input_tokens"] == short.json()["usage"]["input_tokens"], (cut.json(), short.json())
    assert cut.json()["output"][0]["content"][0]["text"] == short.json()["output"][0]["content"][0]["text"]
    assert cut.json()["truncation"] == "auto"


def test_responses_input_checks_match_chat_completions(http):
    empty = {"input": [{"role": "user", "content": []}]}
    error = _refused(http.post("/v1/responses", json=empty), 400, "input[0].content")
    assert "empty array" in error["message"], error
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": []}]})
    _refused(chat, 400, "messages[0].content")
    _refused(http.post("/v1/responses", json={"input": ""}), 400, "input")
    _refused(http.post("/v1/responses", json={"input": []}), 400, "input")
    # Reasoning items alone leave no turn: the error names input, not chat's messages.
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think."}]}
    error = _refused(http.post("/v1/responses", json={"input": [reasoning]}), 400, "input", "invalid_value")
    assert error["message"].startswith("input holds no message"), error
    unstreamed = {"input": "Hi", "max_output_tokens": 1, "stream_options": {"include_obfuscation": False}}
    _refused(http.post("/v1/responses", json=unstreamed), 400, "stream_options")
    streamed = http.post("/v1/responses", json={**unstreamed, "stream": True})
    assert streamed.status_code == 200 and "event: response.incomplete" in streamed.text, streamed.text

    refusal = {"type": "refusal", "refusal": "I cannot help with that."}
    turns = [
        {"role": "user", "content": "Help me."},
        {"type": "message", "role": "assistant", "content": [refusal]},
        {"role": "user", "content": "Say hi then."},
    ]
    r = http.post("/v1/responses", json={"input": turns, "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    # A refusal part is an assistant's: a user's is still refused.
    _refused(http.post("/v1/responses", json={"input": [{"role": "user", "content": [refusal]}]}),
             400, "input[0].content[0]")


@pytest.mark.parametrize(
    ("item", "param", "code"),
    [
        ({"role": ["user"], "content": "Hi"}, "input[0].role", "invalid_type"),  # was a 500 (unhashable)
        ({"type": "message", "content": "Hi"}, "input[0].role", "missing_field"),
        ({"role": "nobody", "content": "Hi"}, "input[0].role", "invalid_value"),
        ({"role": "user"}, "input[0].content", "missing_field"),
        ({"role": "user", "content": 123}, "input[0].content", "invalid_type"),
    ],
)
def test_a_message_items_fields_have_the_documented_codes(http, item, param, code):
    """As chat completions' messages: a field absent is missing_field, one of the wrong
    JSON type invalid_type, never a 500."""
    _refused(http.post("/v1/responses", json={"input": [item], "max_output_tokens": 1}), 400, param, code)


def test_include_and_metadata_are_checked_as_openai_checks_them(http):
    """An unknown include value and metadata that is not a map of strings were taken
    (200, the metadata echoed as sent): now 400s naming the field, as OpenAI answers."""
    body = {"input": "Hi", "max_output_tokens": 1}
    error = _refused(http.post("/v1/responses", json={**body, "include": ["bogus"]}),
                     400, "include[0]", "invalid_value")
    assert "'bogus'" in error["message"] and "reasoning.encrypted_content" in error["message"], error
    _refused(http.post("/v1/responses", json={**body, "include": "bogus"}), 400, "include", "invalid_type")
    _refused(http.post("/v1/responses", json={**body, "metadata": {"a": 1}}), 400, "metadata.a", "invalid_type")
    _refused(http.post("/v1/responses", json={**body, "metadata": {"a": "x" * 513}}), 400, "metadata.a")
    _refused(http.post("/v1/responses", json={**body, "metadata": {"k" * 65: "x"}}), 400, "metadata")
    many = {f"k{i}": "x" for i in range(17)}
    _refused(http.post("/v1/responses", json={**body, "metadata": many}), 400, "metadata")
    # OpenAI's own values and a map of strings are served; an unknown field is ignored,
    # as chat completions ignore one.
    ok = http.post("/v1/responses", json={**body, "include": ["reasoning.encrypted_content"],
                                           "metadata": {**dict(list(many.items())[:15]), "a": "x" * 512},
                                           "stop": ["x"]})
    assert ok.status_code == 200 and ok.json()["metadata"]["a"] == "x" * 512, ok.text


def test_the_response_carries_the_sampling_used(http):
    defaults = dict(line.split() for line in http.post("/api/show", json={"model": "default"}).json()[
        "parameters"].splitlines())
    r = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert (r.json()["temperature"], r.json()["top_p"]) == (float(defaults["temperature"]), float(defaults["top_p"]))
    assert r.json()["temperature"] is not None and r.json()["top_p"] is not None
    set_ = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "temperature": 0.7, "top_p": 0.5})
    assert (set_.json()["temperature"], set_.json()["top_p"]) == (0.7, 0.5), set_.text
    with http.stream("POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "stream": True}) as s:
        created = next(line for line in s.iter_lines() if line.startswith("data:"))
    assert '"temperature":' + defaults["temperature"] in created.replace(" ", ""), created


def test_stored_responses_and_unknown_paths_are_404s_with_a_code(http):
    for method, path in [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1"), ("GET", "/v1/responses/resp_1/input_items"),
                         ("POST", "/v1/responses/resp_1/cancel")]:
        r = http.request(method, path, json={} if method == "POST" else None)
        error = _refused(r, 404, None, "response_not_found")
        assert error["message"].startswith("headroom does not store responses:"), (method, path, error)
        assert error["type"] == "not_found_error"
    for path in ("/v1/nothing", "/v1/responses/resp_1/other/part"):
        error = _refused(http.get(path), 404, None, "route_not_found")
        assert path in error["message"], error


def test_refusals_before_the_engine_count_under_their_route(http):
    served = SimpleNamespace(base_url=str(http.base_url).rstrip("/"))
    before = scrape(served)
    for path in ("/v1/embeddings", "/api/embed", "/api/embeddings"):
        assert http.post(path, json={"model": "default", "input": "hi"}).status_code == 501, path
    http.get("/v1/responses/resp_1/other/part")
    http.get("/v1/responses/resp_1")
    after = scrape(served)

    def moved(route: str, outcome: str) -> float:
        return value(after, "headroom_requests_total", route=route, outcome=outcome) - value(
            before, "headroom_requests_total", route=route, outcome=outcome)

    for path in ("/v1/embeddings", "/api/embed", "/api/embeddings"):
        assert moved(path, "501") == 1, path
    assert moved("/v1/responses", "404") == 0
    assert moved("/v1/responses/{response_id}", "404") == 1


def test_ollama_takes_greedy_options_as_llama_cpp_does(http):
    question = [{"role": "user", "content": "Name three colours."}]
    short = {"model": "default", "stream": False}
    greedy = http.post("/api/chat", json={**short, "messages": question, "options": {"num_predict": 12, "temperature": 0}})
    assert greedy.status_code == 200, greedy.text
    for options in ({"top_p": 0, "temperature": 1.5, "seed": 7}, {"temperature": -1, "seed": 8}):
        r = http.post("/api/chat", json={**short, "messages": question, "options": {"num_predict": 12, **options}})
        assert r.status_code == 200, (options, r.text)
        assert r.json()["message"]["content"] == greedy.json()["message"]["content"], options
        g = http.post("/api/generate", json={**short, "prompt": "Hi", "options": {"num_predict": 1, **options}})
        assert g.status_code == 200, (options, g.text)
    chat = {"messages": question, "max_tokens": 1}
    _refused(http.post("/v1/chat/completions", json={**chat, "top_p": 0}), 400, "top_p")
    _refused(http.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400, "temperature")


def test_openapi_lists_the_control_routes(http):
    doc = http.get("/schema/openapi.json").json()
    for action in ("restart", "pause", "resume", "reserve", "cache"):
        assert "post" in doc["paths"][f"/api/control/{action}"], action
    cache = doc["components"]["schemas"]["CacheRequest"]
    assert "clear_prefix_cache" in cache["properties"] and "done last" in cache["description"], cache
