"""What the API refuses to take, against a real ``headroom serve`` (default model,
``--api-key``): bodies the decoder cannot take, integer ranges (``seed``...), body and
header size limits, prompts too long to tokenize, and the waiting-request bound while
one tokenizes.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest
from keyed_server import CHAT, COMPLETION, KEY, Raw, auth
from test_service_cases import assert_openai_error

pytestmark = pytest.mark.slow



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
        (
            "a lone surrogate",  # served or refused; if served, one token is enough
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
            ...,
        ),
    ],
)
def test_bodies_the_decoder_cannot_take_are_400(keyed_server, name, body, param):
    r = Raw(keyed_server, "POST", "/v1/chat/completions", body, auth())
    if param is ... and r.status == 200:
        return  # a lone surrogate is valid JSON; it may be served (as U+FFFD)
    assert r.status == 400, (name, r.status, r.body[:300])
    error = r.error()
    assert error["type"] == "invalid_request_error", error
    if param is not ...:
        assert error["param"] == param, error


def test_deep_nesting_leaves_one_log_line_and_no_traceback(keyed_server):
    before = keyed_server.log()
    r = Raw(keyed_server, "POST", "/v1/chat/completions", _nested(1000), auth())
    assert r.status == 400 and r.error()["code"] == "too_deep"
    deadline = time.monotonic() + 30
    while "too_deep" not in keyed_server.log()[len(before) :] and time.monotonic() < deadline:
        time.sleep(0.05)
    new = keyed_server.log()[len(before) :]
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
        # A divisor that overflows a logit to +inf left the row unsampleable.
        ("repetition_penalty", 5e-324, "repetition_penalty", ...),
        ("stop", ["x"] * 10_000, "stop", ...),
        ("stop", "s" * 100_000, "stop", ...),
        ("logprobs", "yes", "logprobs", ...),
        ("top_logprobs", 21, "top_logprobs", ...),
        ("top_logprobs", 2**64, "top_logprobs", ...),
    ],
)
def test_fields_out_of_range_are_400_naming_the_field(keyed_server, field, value, param, code):
    r = Raw(keyed_server, "POST", "/v1/chat/completions", {**CHAT, field: value}, auth())
    assert r.status == 400, (field, value, r.body[:300])
    error = r.error()
    assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error


def test_completions_check_the_same_ranges(keyed_server):
    for field, value in (("seed", 2**64), ("n", 10**6), ("top_k", 2**70), ("max_tokens", 2**63)):
        r = Raw(keyed_server, "POST", "/v1/completions", {**COMPLETION, field: value}, auth())
        assert r.status == 400 and r.error()["param"] == field, (field, r.body)
    r = Raw(keyed_server, "POST", "/v1/completions", {**COMPLETION, "prompt": [2**64]}, auth())
    assert r.status == 400 and r.error()["param"] == "prompt", r.body


@pytest.mark.parametrize("prompt", [[True], [[True]], [[1, False]], [[1], [True, 2]]])
def test_a_boolean_token_id_is_refused_and_the_worker_lives(keyed_server, prompt):
    """JSON's true is no token id: a list of id lists holding one reached the worker,
    whose decoder refused it and exited, twice (the retry on the next worker too), every
    other client getting 503 engine_restarting meanwhile."""
    health = json.loads(Raw(keyed_server, "GET", "/api/health").body)
    r = Raw(keyed_server, "POST", "/v1/completions", {**COMPLETION, "prompt": prompt}, auth())
    assert r.status == 400, r.body
    error = r.error()
    assert error["param"] == "prompt" and error["code"] == "invalid_type", error
    after = json.loads(Raw(keyed_server, "GET", "/api/health").body)
    assert (after["worker_pid"], after["restarts"]) == (health["worker_pid"], health["restarts"]), after


def test_seeds_at_the_ends_of_the_range_are_served_and_differ(keyed_server):
    texts = {}
    for seed in (0, 2**63 - 1):
        body = {**CHAT, "max_tokens": 8, "temperature": 1.5, "seed": seed}
        r = Raw(keyed_server, "POST", "/v1/chat/completions", body, auth())
        assert r.status == 200, r.body
        texts[seed] = json.loads(r.body)["choices"][0]["message"]["content"]
        again = Raw(keyed_server, "POST", "/v1/chat/completions", body, auth())
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
def test_a_100_mb_body_gets_413_without_being_read_whole(keyed_server, chunked):
    total = 100 << 20
    piece = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", keyed_server.port), timeout=120) as sock:
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
    # Answered before the client had sent it all: the keyed_server did not buffer 100 MB.
    assert sent < total, sent
    assert keyed_server.health().status_code == 200


def test_huge_headers_are_refused_before_the_app(keyed_server):
    with socket.create_connection(("127.0.0.1", keyed_server.port), timeout=60) as sock:
        sock.sendall(
            b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
            + b"a" * (1 << 20)
            + b"\r\n\r\n"
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    assert keyed_server.health().status_code == 200


def test_headers_past_max_header_size_are_431_in_the_apis_shape(keyed_server):
    """--max-header-size (64 KiB) holds to the byte: the HTTP parser alone lets through
    up to about twice that (it reads 64 KiB at a time); past it a request gets 431 in its
    API's shape, under it the call is served."""
    big = {**auth(), "X-Big": "a" * 100_000}
    r = httpx.get(keyed_server.base_url + "/v1/models", headers=big, timeout=30)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large", r.text
    assert "--max-header-size" in r.json()["error"]["message"]
    r = httpx.get(keyed_server.base_url + "/api/tags", headers=big, timeout=30)
    assert r.status_code == 431 and set(r.json()) == {"error"} and "--max-header-size" in r.json()["error"], r.text
    ok = httpx.get(keyed_server.base_url + "/v1/models", headers={**auth(), "X-Big": "a" * 60_000}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_a_9_mb_prompt_is_refused_untokenized(keyed_server):
    big = "word " * (9_000_000 // 5)
    r = Raw(
        keyed_server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": big}], "max_tokens": 1},
        auth(),
    )
    assert r.status == 400
    error = r.error()
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "at least" in error["message"]  # the untokenized bound, not a token count
    r = Raw(keyed_server, "POST", "/v1/completions", {"prompt": big, "max_tokens": 1}, auth())
    assert r.status == 400
    assert (r.error()["code"], r.error()["param"]) == ("context_length_exceeded", "prompt")


def test_other_clients_are_served_while_a_long_prompt_tokenizes(keyed_server):
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
        with httpx.Client(base_url=keyed_server.base_url, timeout=600, headers=auth()) as c:
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
    with httpx.Client(base_url=keyed_server.base_url, timeout=120, headers=auth()) as c:
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
        httpx.post(keyed_server.base_url + "/v1/completions", json=COMPLETION, headers=auth()).status_code
        == 200
    )
