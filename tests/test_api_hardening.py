"""The API as an outsider tries it, against a real ``headroom serve`` (default model):
path spellings that must not skip the API key or the local token, bodies the decoder
cannot take, body and header size limits, integer ranges (``seed``...), prompts too
long to tokenize, secrets in the log, the waiting-request bound and the request
timeout.

Paths are sent byte for byte with :mod:`http.client` (httpx and the openai client
normalise some spellings before sending them).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time

import httpx
import openai
import pytest
from service_harness import ServerProcess
from test_service_cases import assert_openai_error
from websockets.sync.client import connect

pytestmark = pytest.mark.slow

KEY = "sk-hardening-0123456789"
CONTEXT_PAGES = 256  # 256 pages x 16 = 4096 tokens
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
COMPLETION = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    """The default model behind ``--api-key``, with at most one request waiting for
    the engine."""
    proc = ServerProcess(
        tmp_path_factory.mktemp("hardening"),
        ["--num-pages", str(CONTEXT_PAGES), "--api-key", KEY, "--max-queued-requests", "1"],
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def auth(secret: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


class Raw:
    """One HTTP/1.1 answer to a request sent with its path exactly as given."""

    def __init__(self, server: ServerProcess, method: str, path: str, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            payload = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=payload, headers=hdrs)
            response = conn.getresponse()
            self.status = response.status
            self.headers = {k.lower(): v for k, v in response.getheaders()}
            self.body = response.read()
        finally:
            conn.close()

    def error(self) -> dict:
        assert self.headers["content-type"].startswith("application/json"), self.body
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error


def spellings(path: str) -> list[str]:
    """``path`` spelled each way a client or a proxy might: doubled, dotted,
    percent-encoded, with trailing or repeated slashes."""
    head, tail = path.split("/", 2)[1], path.split("/", 2)[2]  # "v1" / "api", rest
    return sorted(
        {
            path,
            "/" + path,
            path + "/",
            path + "//",
            path + "?x=1",
            f"/{head}//{tail}",
            f"//{head}//{tail}//",
            f"/{head}/./{tail}",
            f"/{head}/../{head}/{tail}",
            f"/x/../{head}/{tail}",
            f"/%{ord(head[0]):02x}{head[1:]}/{tail}",
            f"/{head}%2F{tail}",
            f"/{head}/{tail.replace('/', '%2F')}",
            f"/{head.upper()}/{tail}",
        }
    )


PROTECTED_V1 = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", COMPLETION),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED_V1)
def test_every_spelling_of_a_v1_route_needs_the_api_key(server, method, path, body):
    reached = []
    for spelled in spellings(path):
        with_key = Raw(server, method, spelled, body, auth())
        without = Raw(server, method, spelled, body)
        wrong = Raw(server, method, spelled, body, auth("sk-wrong"))
        assert with_key.status in (200, 404), (spelled, with_key.status, with_key.body)
        if with_key.status == 404:
            # Not a route: the same 404 with or without the key.
            assert without.status == 404, (spelled, without.body)
            continue
        reached.append(spelled)
        for refused in (without, wrong):
            assert refused.status == 401, (spelled, refused.status, refused.body)
            error = refused.error()
            assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
            assert refused.headers["www-authenticate"] == "Bearer"
    # The router normalises several spellings; each of them went through the guard.
    assert path in reached and len(reached) >= 5, reached


def test_openai_client_with_a_doubled_slash_base_url_needs_the_key(server):
    for base in (server.base_url + "//v1", server.base_url + "/v1//", server.base_url + "/v1/."):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/control/restart", None),
        ("/api/control/reserve", {"reserve": "auto"}),
        ("/api/control/cache", {"clear_prefix_cache": True}),
    ],
)
def test_every_spelling_of_a_control_route_needs_the_local_token(server, path, body):
    reached = []
    for spelled in spellings(path):
        for headers in ({}, auth("not-the-token-0123456789"), auth(KEY)):
            r = Raw(server, "POST", spelled, body, headers)
            assert r.status in (401, 404), (spelled, r.status, r.body)
            if r.status == 401:
                assert r.error()["code"] == "invalid_token"
                reached.append(spelled)
    assert path in reached and len(reached) >= 5 * 3, reached
    # The guard lets the right token through (a restart is left out: it would cost a
    # model load).
    if path == "/api/control/cache":
        for spelled in (path, "/api//control/cache", "/api/control/cache/"):
            r = Raw(server, "POST", spelled, body, auth(server.token))
            assert r.status == 202, (spelled, r.body)


def test_open_routes_stay_open_and_the_key_guards_v1_only(server):
    assert Raw(server, "GET", "//api/health").status == 200
    assert Raw(server, "GET", "/api/status").status == 200


# -- bodies ----------------------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return (
        b'{"messages": [{"role": "user", "content": "hi", "x": '
        + b"[" * depth
        + b"]" * depth
        + b'}], "max_tokens": 1}'
    )


@pytest.mark.parametrize(
    ("name", "body", "param"),
    [
        ("nested 1,000", _nested(1000), None),
        ("nested 100,000", _nested(100_000), None),
        (
            "nested content",
            b'{"messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
            None,
        ),
        ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}', None),
        ("NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
        ("Infinity", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', None),
        (
            "1e999",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
            "temperature",
        ),
        ("not an object", b"[1, 2, 3]", None),
        ("truncated", b'{"messages": [', None),
        ("a lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', ...),
    ],
)
def test_bodies_the_decoder_cannot_take_are_400(server, name, body, param):
    r = Raw(server, "POST", "/v1/chat/completions", body, auth())
    if param is ... and r.status == 200:
        return  # a lone surrogate is valid JSON; it may be served (as U+FFFD)
    assert r.status == 400, (name, r.status, r.body[:300])
    error = r.error()
    assert error["type"] == "invalid_request_error", error
    if param is not ...:
        assert error["param"] == param, error


def test_deep_nesting_leaves_one_log_line_and_no_traceback(server):
    before = server.log()
    r = Raw(server, "POST", "/v1/chat/completions", _nested(1000), auth())
    assert r.status == 400 and r.error()["code"] == "too_deep"
    deadline = time.monotonic() + 30
    while "too_deep" not in server.log()[len(before) :] and time.monotonic() < deadline:
        time.sleep(0.05)
    new = server.log()[len(before) :]
    assert [line for line in new.splitlines() if "too_deep" in line], new
    assert len([line for line in new.splitlines() if "too_deep" in line]) == 1, new
    assert "Traceback" not in new and "RecursionError" not in new, new


@pytest.mark.parametrize(
    ("field", "value", "param", "code"),
    [
        ("seed", 2**64, "seed", ...),
        ("seed", 2**63, "seed", ...),
        ("seed", -1, "seed", ...),
        ("seed", 10**40, "seed", ...),
        ("n", 10**6, "n", ...),
        ("n", 2**64, "n", ...),
        ("n", 0, "n", ...),
        ("max_tokens", 2**63, "max_tokens", "context_length_exceeded"),
        ("max_tokens", 2**64 + 5, "max_tokens", "context_length_exceeded"),
        ("max_tokens", -1, "max_tokens", ...),
        ("max_completion_tokens", 2**63, "max_completion_tokens", "context_length_exceeded"),
        ("top_k", 2**70, "top_k", ...),
        ("top_k", -2, "top_k", ...),
        ("temperature", 1e308, "temperature", ...),
        ("stop", ["x"] * 10_000, "stop", ...),
        ("stop", "s" * 100_000, "stop", ...),
        ("logprobs", "yes", "logprobs", ...),
        ("top_logprobs", 21, "top_logprobs", ...),
        ("top_logprobs", 2**64, "top_logprobs", ...),
    ],
)
def test_fields_out_of_range_are_400_naming_the_field(server, field, value, param, code):
    r = Raw(server, "POST", "/v1/chat/completions", {**CHAT, field: value}, auth())
    assert r.status == 400, (field, value, r.body[:300])
    error = r.error()
    assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error


def test_completions_check_the_same_ranges(server):
    for field, value in (("seed", 2**64), ("n", 10**6), ("top_k", 2**70), ("max_tokens", 2**63)):
        r = Raw(server, "POST", "/v1/completions", {**COMPLETION, field: value}, auth())
        assert r.status == 400 and r.error()["param"] == field, (field, r.body)
    r = Raw(server, "POST", "/v1/completions", {**COMPLETION, "prompt": [2**64]}, auth())
    assert r.status == 400 and r.error()["param"] == "prompt", r.body


def test_seeds_at_the_ends_of_the_range_are_served_and_differ(server):
    texts = {}
    for seed in (0, 2**63 - 1):
        body = {**CHAT, "max_tokens": 8, "temperature": 1.5, "seed": seed}
        r = Raw(server, "POST", "/v1/chat/completions", body, auth())
        assert r.status == 200, r.body
        texts[seed] = json.loads(r.body)["choices"][0]["message"]["content"]
        again = Raw(server, "POST", "/v1/chat/completions", body, auth())
        assert json.loads(again.body)["choices"][0]["message"]["content"] == texts[seed]
    # No wrapping: the two ends of the range are different seeds.
    assert texts[0] != texts[2**63 - 1]


# -- sizes ---------------------------------------------------------------------------------------


def _read_answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(
        next(
            (
                line.split(b":", 1)[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            b"0",
        )
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def _send_until_answered(sock: socket.socket, chunks, limit: int) -> tuple[bytes, int]:
    """Send ``chunks`` until the server answers (or ``limit`` bytes went out); return
    the answer and the bytes sent."""
    sent = 0
    for chunk in chunks:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable or sent >= limit:
            break
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(chunk)
    sock.settimeout(120)
    return _read_answer(sock), sent


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_100_mb_body_gets_413_without_being_read_whole(server, chunked):
    total = 100 << 20
    piece = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}".encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
            + framing
            + b"\r\n\r\n"
        )
        frame = (b"%x\r\n" % len(piece)) + piece + b"\r\n" if chunked else piece
        answer, sent = _send_until_answered(sock, [frame] * 100, total)
    status, error = _status_and_error(answer)
    assert status == 413, answer[:300]
    assert error["code"] == "request_too_large" and "--max-body-size" in error["message"]
    # Answered before the client had sent it all: the server did not buffer 100 MB.
    assert sent < total, sent
    assert server.health().status_code == 200


def test_huge_headers_are_refused_before_the_app(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(
            b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
            + b"a" * (1 << 20)
            + b"\r\n\r\n"
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    assert server.health().status_code == 200


def test_a_9_mb_prompt_is_refused_untokenized(server):
    big = "word " * (9_000_000 // 5)
    r = Raw(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": big}], "max_tokens": 1},
        auth(),
    )
    assert r.status == 400
    error = r.error()
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "at least" in error["message"]  # the untokenized bound, not a token count
    r = Raw(server, "POST", "/v1/completions", {"prompt": big, "max_tokens": 1}, auth())
    assert r.status == 400
    assert (r.error()["code"], r.error()["param"]) == ("context_length_exceeded", "prompt")


def test_other_clients_are_served_while_a_long_prompt_tokenizes(server):
    """A request whose 40 prompts each pass the cheap bound but must be tokenized
    (300 kB, 75k tokens each) keeps the tokenizer threads busy.
    Meanwhile health checks are answered (the event loop is free) and, as that request
    holds the one waiting place (``--max-queued-requests 1``), another completion is
    refused at once with 503 ``queue_full`` and Retry-After."""
    prompts = ["hello world " * 25_000] * 40
    result: dict = {}

    def heavy() -> None:
        # Our own small request may hold the one place for a moment: retry as a client
        # honouring Retry-After would.
        with httpx.Client(base_url=server.base_url, timeout=600, headers=auth()) as c:
            for _ in range(100):
                r = c.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1})
                if r.status_code != 503:
                    break
            result["r"] = r

    thread = threading.Thread(target=heavy)
    thread.start()
    health_while_pending = 0
    refused: httpx.Response | None = None
    # Only this loop's one request at a time competes with the heavy one: a 503 here
    # means the heavy request holds the waiting place.
    with httpx.Client(base_url=server.base_url, timeout=120, headers=auth()) as c:
        while thread.is_alive():
            if c.get("/api/health").status_code == 200 and thread.is_alive():
                health_while_pending += 1
            r = c.post("/v1/completions", json=COMPLETION)
            if r.status_code == 503 and thread.is_alive():
                refused = r
    thread.join()
    heavy_answer = result["r"]
    assert heavy_answer.status_code == 400, heavy_answer.text
    assert heavy_answer.json()["error"]["code"] == "context_length_exceeded"
    assert health_while_pending >= 1
    assert refused is not None, "no request was refused while one waited"
    assert_openai_error(refused, 503, code="queue_full")
    assert int(refused.headers["retry-after"]) >= 1
    # The place is free again.
    assert (
        httpx.post(server.base_url + "/v1/completions", json=COMPLETION, headers=auth()).status_code
        == 200
    )


# -- secrets in the log --------------------------------------------------------------------------


def test_no_secret_reaches_the_log(server):
    token = server.token
    with connect(f"{server.ws_url}?token={token}") as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "snapshot"
    with connect(server.ws_url, subprotocols=[f"headroom.token.{token}"]) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "snapshot"
    Raw(server, "GET", f"/v1/models?api_key={KEY}&token={token}")
    Raw(server, "GET", f"//v1/nothing?token={token}", headers=auth(KEY))
    deadline = time.monotonic() + 30
    while server.log().count("WebSocket") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log()
    assert "WebSocket" in log  # uvicorn logged the handshakes...
    assert token not in log and KEY not in log  # ...without the secrets
    assert "<redacted>" in log


# -- the request timeout -------------------------------------------------------------------------


def test_a_request_past_the_timeout_is_aborted_and_answered(start_server):
    """``--request-timeout 1``: a completion of 3,000 tokens (it cannot finish in a
    second on this model's CPU speed) ends with 504 ``request_timeout``; a stream ends
    with an error event and ``[DONE]``; the engine holds nothing after either."""
    server = start_server(["--num-pages", "512", "--request-timeout", "1"])
    long = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
    with server.client() as http:
        assert_openai_error(http.post("/v1/completions", json=long), 504, code="request_timeout")
        with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        deadline = time.monotonic() + 60
        while (
            http.get("/api/status").json()["counters"]["in_flight"] and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert http.get("/api/status").json()["counters"]["in_flight"] == 0
