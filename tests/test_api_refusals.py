"""What a real ``headroom serve`` (the default model) answers to calls it refuses: the
cap on sequences per call, the words and codes of its 400s, Ollama's own refusals in
Ollama's shape, and bodies that never arrive whole (408, or 499 for a client gone)."""

from __future__ import annotations

import gzip
import json
import re
import socket

import httpx
import pytest
from service_harness import wait_for
from test_api_metrics import scrape, value
from test_service_cases import assert_openai_error

from service.api.request import BODY_READ_TIMEOUT_S

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=120, **kwargs)


def test_more_sequences_than_the_cap_are_refused_at_once(real_server):
    prompts = [f"hi {i}" for i in range(128)]
    r = _post(real_server, "/v1/completions", json={"prompt": prompts, "n": 128, "max_tokens": 1})
    error = assert_openai_error(r, 400, param="n", code="too_many_sequences")
    assert "16384" in error["message"] and "128" in error["message"], error
    r = _post(real_server, "/v1/completions", json={"prompt": [*prompts, "one more"], "max_tokens": 1})
    assert_openai_error(r, 400, param="prompt", code="too_many_sequences")
    # At the cap, the call is served.
    r = _post(real_server, "/v1/completions", json={"prompt": prompts[:2], "n": 64, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128, r.text[:300]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "messages", "missing_field"),
        ({"messages": HI, "temperature": "hot"}, "temperature", "invalid_type"),
        ({"messages": HI, "temperature": 5}, "temperature", "invalid_value"),
        ({"messages": HI, "n": 0}, "n", "invalid_value"),
        ({"messages": [{"role": "nobody", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        ({"messages": HI, "stop": ["x"] * 65}, "stop", "invalid_value"),
    ],
)
def test_every_400_has_a_code_naming_its_kind(real_server, body, param, code):
    r = _post(real_server, "/v1/chat/completions", json=body)
    assert_openai_error(r, 400, param=param, code=code)


@pytest.mark.parametrize("stop", ["", ["", "x"]])
def test_an_empty_stop_string_is_refused_naming_the_field_on_every_api(real_server, stop):
    """An empty stop string would match everywhere (vLLM and Anthropic refuse it): each
    API answers 400 in its own shape naming its field, rather than dropping it unsaid."""
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})):
        r = _post(real_server, path, json={**body, "stop": stop, "max_tokens": 2})
        assert "empty string" in assert_openai_error(r, 400, param="stop", code="invalid_value")["message"]
    for path, body in (("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "hi"})):
        r = _post(real_server, path, json={**body, "model": "default", "stream": False,
                                           "options": {"stop": stop, "num_predict": 2}})
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        assert r.json()["error"].startswith("options.stop cannot contain an empty string"), r.text
    stops = [stop] if isinstance(stop, str) else stop
    r = _post(real_server, "/v1/messages", json={"model": "default", "max_tokens": 2, "messages": HI,
                                                 "stop_sequences": stops})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith("stop_sequences cannot contain an empty string"), r.text
    r = _post(real_server, "/v1/chat/completions", json={"messages": HI, "stop": ["x"], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_anthropic_temperature_above_1_is_refused_where_openai_takes_it(real_server):
    """Anthropic's temperature is 0..1 (OpenAI's 0..2): /v1/messages answers 1.5 with
    Anthropic's 400 naming temperature, where it sampled at 1.5; /v1 still takes it."""
    body = {"model": "default", "max_tokens": 1, "messages": HI}
    r = _post(real_server, "/v1/messages", json={**body, "temperature": 1.5})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "temperature: Expected `float` <= 1.0" in r.json()["error"]["message"], r.text
    assert _post(real_server, "/v1/messages", json={**body, "temperature": 1}).status_code == 200
    r = _post(real_server, "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "temperature": 1.5})
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_json_is_invalid_json(real_server):
    for raw in (b"", b"{not json"):
        r = _post(real_server, "/v1/chat/completions", content=raw)
        assert_openai_error(r, 400, code="invalid_json")


def test_a_compressed_body_is_415_in_each_apis_shape(real_server):
    """A gzip body was a 400 invalid_json quoting its bytes: now 415 saying compressed
    bodies are not accepted, in each API's shape; identity is plain JSON."""
    chat = {"model": "default", "messages": HI, "max_tokens": 1}
    gz = {"content-type": "application/json", "content-encoding": "gzip"}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        r = _post(real_server, path, content=gzip.compress(json.dumps(body).encode()), headers=gz)
        error = assert_openai_error(r, 415, code="unsupported_content_encoding")
        assert error["message"].startswith("compressed request bodies are not accepted (Content-Encoding: gzip)")
    r = _post(real_server, "/v1/messages", content=gzip.compress(json.dumps(chat).encode()), headers=gz)
    assert r.status_code == 415 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith("compressed request bodies are not accepted"), r.text
    r = _post(real_server, "/api/chat", content=gzip.compress(json.dumps({**chat, "stream": False}).encode()),
              headers=gz)
    assert r.status_code == 415 and r.json()["error"].startswith("compressed request bodies"), r.text
    r = _post(real_server, "/v1/chat/completions", json=chat, headers={"content-encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_negative_logit_bias_id_names_the_vocabulary_range(real_server):
    r = _post(real_server, "/v1/chat/completions", json={"messages": HI, "logit_bias": {"-1": 1}})
    error = assert_openai_error(r, 400, param="logit_bias", code="invalid_value")
    assert re.search(r"\(0\.\.[1-9]\d*\)", error["message"]), error


@pytest.mark.parametrize(("bias", "needle"), [
    ({"05": 1, "5": 2}, "logit_bias keys are token ids, got '05'"),
    ({" 5": 1}, "logit_bias keys are token ids, got ' 5'"),
    ({"+5": 1}, "logit_bias keys are token ids, got '+5'"),
    ({"\u0665": 1}, "logit_bias keys are token ids"),  # an Arabic-Indic five, which int() reads
])
def test_logit_bias_keys_are_plain_token_ids(bias, needle):
    """Spellings int() reads ("05", " 5") were taken, so two keys could name one token
    with two biases, the last silently winning."""
    from service.api.sampling import logit_bias_pairs
    from service.common.errors import APIError

    with pytest.raises(APIError, match=re.escape(needle)) as raised:
        logit_bias_pairs(bias)
    assert raised.value.param == "logit_bias"
    assert logit_bias_pairs({"0": 1, "5": -100, "-1": 2}) == ((0, 1.0), (5, -100.0), (-1, 2.0))


def test_a_text_part_without_text_says_so(real_server):
    content = [{"type": "text"}]
    r = _post(real_server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    error = assert_openai_error(r, 400, param="messages[0].content[0].text", code="missing_field")
    assert "not supported" not in error["message"] and "text" in error["message"], error


def test_ollama_num_predict_beyond_the_context_generates_to_its_end(real_server):
    """As Ollama: ``num_predict`` is a limit, so more than the context holds generates up
    to its end (here a 40-token context) instead of a 400; integer options take
    whole-number floats, and a fraction is a 400 naming the option."""
    r = _post(real_server, "/api/generate", json={
        "model": "default", "prompt": "hi", "stream": False,
        "options": {"num_predict": 10**6, "num_ctx": 40.0, "temperature": 0, "seed": 3.0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["done"] and body["prompt_eval_count"] + body["eval_count"] <= 40, body
    assert body["done_reason"] in ("length", "stop"), body
    r = _post(real_server, "/api/chat", json={"model": "default", "messages": HI, "stream": False,
                                              "options": {"num_predict": 5.5}})
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert r.json()["error"] == "options.num_predict must be a whole number, got 5.5", r.text
    # A num_ctx that the chat template's own tokens pass is refused, naming it.
    r = _post(real_server, "/api/generate", json={"model": "default", "prompt": "hi " * 200, "stream": False,
                                                  "options": {"num_ctx": 16}})
    assert r.status_code == 400 and r.json()["error"].endswith("Please raise num_ctx."), r.text


def test_ollama_drops_the_oldest_turns_to_fit_num_ctx_as_ollama_does(real_server):
    """A conversation longer than ``num_ctx`` drops its oldest turns (the system message and
    the last turn kept) rather than a 400, and answers as the conversation that is left;
    a raw prompt keeps its last tokens."""
    long = "tell me about the history of computing " * 12
    system = {"role": "system", "content": "Be brief."}
    last = {"role": "user", "content": "Say hi"}
    history = [system, {"role": "user", "content": long}, {"role": "assistant", "content": long}, last]
    options = {"num_ctx": 96, "num_predict": 6, "temperature": 0}

    def chat(messages):
        r = _post(real_server, "/api/chat", json={"model": "default", "messages": messages, "stream": False,
                                                  "options": options})
        assert r.status_code == 200, r.text
        return r.json()

    cut, kept = chat(history), chat([system, last])
    assert cut["prompt_eval_count"] == kept["prompt_eval_count"] < 96, (cut, kept)
    assert cut["message"]["content"] == kept["message"]["content"]
    r = _post(real_server, "/api/generate", json={"model": "default", "prompt": long, "raw": True, "stream": False,
                                                  "options": {"num_ctx": 16, "num_predict": 1}})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 15, r.text


def test_ollama_fits_a_chat_of_many_turns_and_stays_answering(real_server):
    """A chat of 20,000 turns was cut one turn a render, each render of the whole chat:
    the call never answered and the service spent a core on it long after the client
    left. The turns to drop are found by halving, and the call answers."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(20_000)]
    r = _post(real_server, "/api/chat", json={"model": "default", "messages": turns, "stream": False,
                                              "options": {"num_ctx": 256, "num_predict": 2}})
    assert r.status_code == 200 and 0 < r.json()["prompt_eval_count"] <= 254, r.text[:300]
    r = _post(real_server, "/api/chat", json={"model": "default", "messages": HI, "stream": False,
                                              "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.json()["done"], r.text


LONG = "tell me about the history of computing " * 40  # about 280 tokens


def _ollama(server, path: str, body: dict) -> dict:
    """An Ollama call's final object, whole or the last line of its stream."""
    r = _post(server, path, json={"model": "default", **body})
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert all("error" not in line for line in lines) and lines[-1]["done"], r.text
    return lines[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_cuts_a_raw_prompt_leaving_the_answer_its_room(real_server, stream):
    """A raw prompt longer than ``num_ctx`` was cut to num_ctx - 1 tokens and answered
    with one token; it keeps at most num_ctx - min(num_predict, num_ctx / 2) tokens, and
    half the context with num_predict -1 or unset (a default above it)."""
    body = {"prompt": LONG, "raw": True, "stream": stream}
    done = _ollama(real_server, "/api/generate", {**body, "options": {"num_ctx": 64, "num_predict": 10,
                                                                       "temperature": 0}})
    assert (done["prompt_eval_count"], done["eval_count"], done["done_reason"]) == (54, 10, "length"), done
    for options in ({"num_ctx": 64, "num_predict": -1}, {"num_ctx": 64}):
        done = _ollama(real_server, "/api/generate", {**body, "options": {**options, "temperature": 0}})
        assert done["prompt_eval_count"] == 32, (options, done)
        assert done["prompt_eval_count"] + done["eval_count"] <= 64, (options, done)


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_cuts_a_templated_prompt_instead_of_refusing_it(real_server, stream):
    """A non-raw /api/generate prompt and a chat whose system message alone pass
    ``num_ctx`` were 400s; as Ollama, the longest message loses its start (the template's
    head and the end of the conversation kept) and the call is answered. /v1 keeps its
    400 context_length_exceeded, as OpenAI."""
    options = {"num_ctx": 96, "num_predict": 6, "temperature": 0}
    generated = _ollama(real_server, "/api/generate", {"prompt": LONG + "Say hi", "stream": stream,
                                                       "options": options})
    chat = _ollama(real_server, "/api/chat", {"stream": stream, "options": options, "messages": [
        {"role": "system", "content": LONG}, {"role": "user", "content": "Say hi"}]})
    for done in (generated, chat):
        assert 80 <= done["prompt_eval_count"] <= 90 and done["eval_count"] >= 1, done
    # A content of text parts is cut as its text (it was a 400 asking to raise num_ctx).
    parts = _ollama(real_server, "/api/chat", {"stream": stream, "options": options, "messages": [
        {"role": "system", "content": [{"type": "text", "text": LONG}]}, {"role": "user", "content": "Say hi"}]})
    assert (parts["prompt_eval_count"], parts["message"]) == (chat["prompt_eval_count"], chat["message"]), parts
    # The template's own 30 tokens pass the 20 a num_ctx of 40 leaves the prompt: the
    # prompt fills the context but one token.
    tiny = _ollama(real_server, "/api/generate", {"prompt": LONG, "stream": stream,
                                                  "options": {"num_ctx": 40, "temperature": 0}})
    assert (tiny["prompt_eval_count"], tiny["eval_count"]) == (39, 1), tiny
    r = _post(real_server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": LONG * 20}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_ollama_refuses_a_message_without_content_as_one_with_null(real_server):
    for message in ({"role": "user"}, {"role": "user", "content": None}):
        r = _post(real_server, "/api/chat", json={"model": "default", "messages": [message], "stream": False})
        assert r.status_code == 400 and "content" in r.json()["error"], (message, r.text)


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_ollama_calls_without_a_model_are_400(real_server, path):
    for body in ({}, {"prompt": "hi", "messages": HI}):
        r = _post(real_server, path, json=body)
        assert r.status_code == 400 and r.json() == {"error": "model is required"}, (body, r.text)


def test_a_refused_host_answers_ollama_routes_in_ollamas_shape(real_server):
    r = httpx.get(real_server.base_url + "/api/tags", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 403 and set(r.json()) == {"error"} and "evil.example" in r.json()["error"], r.text
    # headroom's own /api routes keep OpenAI's shape.
    r = httpx.get(real_server.base_url + "/api/status", headers={"Host": "evil.example:8080"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host", r.text
    assert "start headroom serve with --allowed-host evil.example " in r.json()["error"]["message"], r.text


def test_routes_other_servers_have_say_what_headroom_does_instead(real_server):
    """``ollama pull`` and an embeddings call are what clients of Ollama and OpenAI try
    first: a 501 in each API's shape naming the way (or that headroom does not), not a
    bare "no route"."""
    import ollama
    import openai

    with pytest.raises(ollama.ResponseError) as pulled:
        ollama.Client(host=real_server.base_url).pull("smollm2")
    assert pulled.value.status_code == 501 and "`headroom pull REPO[:FILE]`" in pulled.value.error, pulled.value
    r = _post(real_server, "/api/embed", json={"model": "default", "input": "hi"})
    assert r.status_code == 501 and set(r.json()) == {"error"} and "no embeddings" in r.json()["error"], r.text
    # The SDKs retry every 5xx unless told not to: with their default retries, one call.
    sent: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.url.path)]})
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", http_client=http)
    with pytest.raises(openai.APIStatusError) as embedded:
        client.embeddings.create(model="default", input="hi")
    assert embedded.value.status_code == 501, embedded.value
    assert_openai_error(embedded.value.response, 501, code="not_implemented")
    assert embedded.value.response.headers["x-should-retry"] == "false" and sent == ["/v1/embeddings"], sent
    assert _post(real_server, "/api/nothing-here", json={}).status_code == 404


# -- bodies that do not arrive ------------------------------------------------------------


def _send_short_body(server, path: str) -> socket.socket:
    """A POST whose Content-Length promises 100 bytes and whose body has 12."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=BODY_READ_TIMEOUT_S * 4)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        + b'{"model": "d'
    )
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def test_a_body_shorter_than_its_content_length_is_408_in_the_apis_shape(start_server):
    # The body never reaches an engine: the fake one serves, with a short --body-timeout
    # instead of the default 30 s to wait out.
    server = start_server(["--body-timeout", "2"], fake=True)
    ollama_call = _send_short_body(server, "/api/chat")
    openai_call = _send_short_body(server, "/v1/chat/completions")
    status, body = _answer(ollama_call)
    assert status == 408 and set(body) == {"error"} and "Content-Length" in body["error"], body
    assert "within 2 s" in body["error"], body
    status, body = _answer(openai_call)
    assert status == 408 and body["error"]["code"] == "body_timeout", body
    paths = httpx.get(server.base_url + "/schema/openapi.json", timeout=30).json()["paths"]
    for path in ("/v1/chat/completions", "/api/chat", "/v1/messages"):
        assert "408" in paths[path]["post"]["responses"], path


def test_a_client_gone_before_its_body_is_counted_499(real_server):
    def gone() -> float:
        return value(scrape(real_server), "headroom_requests_total", route="/v1/chat/completions", outcome="499")

    before = gone()
    _send_short_body(real_server, "/v1/chat/completions").close()
    wait_for(lambda: gone() > before, 60, "a 499 counted")
    assert "POST /v1/chat/completions -> 499" in real_server.log()
    assert "-> 500" not in real_server.log()


@pytest.mark.parametrize(("method", "path", "allowed", "shape"), [
    ("GET", "/api/control/cache", "POST", "openai"),
    ("GET", "/v1/chat/completions", "POST", "openai"),
    ("POST", "/api/health", "GET or HEAD", "openai"),
    ("GET", "/api/chat", "POST", "ollama"),
    ("DELETE", "/api/tags", "GET or HEAD", "ollama"),
    ("GET", "/v1/messages", "POST", "anthropic"),
])
def test_a_wrong_method_names_the_methods_the_path_takes(real_server, method, path, allowed, shape):
    """Every 405 said "method not allowed: Method Not Allowed"; it names the call and the
    methods its path takes, in the error shape of the path's API. A path that answers
    GET answers HEAD too, and its ``Allow`` names both (it named GET alone)."""
    r = httpx.request(method, real_server.base_url + path, timeout=30)
    assert r.status_code == 405, r.text
    allow = [m.strip() for m in r.headers["allow"].split(",")]
    assert ("HEAD" in allow) == ("GET" in allow), r.headers
    if "HEAD" in allow:
        assert httpx.head(real_server.base_url + path, timeout=30).status_code == 200
    message = {"openai": lambda b: b["error"]["message"], "ollama": lambda b: b["error"],
               "anthropic": lambda b: b["error"]["message"]}[shape](r.json())
    assert message == f"{method} {path} is not served: use {allowed}", r.text
    if shape == "anthropic":
        assert r.json()["type"] == "error", r.text
