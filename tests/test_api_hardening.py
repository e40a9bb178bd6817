"""The API's doors as an outsider tries them, against a real ``headroom serve`` (default
model, ``--api-key``): path spellings that must not skip the API key or the local
token, secrets kept out of the log, and the request timeout. What the API refuses to
take (bodies, ranges, sizes) is tested in ``test_api_limits.py``.

Paths are sent byte for byte with :mod:`http.client` (httpx and the openai client
normalise some spellings before sending them).
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import ollama
import openai
import pytest
from keyed_server import CHAT, COMPLETION, KEY, Raw, auth
from test_service_cases import assert_openai_error
from websockets.sync.client import connect

pytestmark = pytest.mark.slow


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
def test_every_spelling_of_a_v1_route_needs_the_api_key(keyed_server, method, path, body):
    reached = []
    for spelled in spellings(path):
        with_key = Raw(keyed_server, method, spelled, body, auth())
        without = Raw(keyed_server, method, spelled, body)
        wrong = Raw(keyed_server, method, spelled, body, auth("sk-wrong"))
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


def test_openai_client_with_a_doubled_slash_base_url_needs_the_key(keyed_server):
    for base in (keyed_server.base_url + "//v1", keyed_server.base_url + "/v1//", keyed_server.base_url + "/v1/."):
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
def test_every_spelling_of_a_control_route_needs_the_local_token(keyed_server, path, body):
    reached = []
    for spelled in spellings(path):
        for headers in ({}, auth("not-the-token-0123456789"), auth(KEY)):
            r = Raw(keyed_server, "POST", spelled, body, headers)
            assert r.status in (401, 404), (spelled, r.status, r.body)
            if r.status == 401:
                assert r.error()["code"] == "invalid_token"
                reached.append(spelled)
    assert path in reached and len(reached) >= 5 * 3, reached
    # The guard lets the right token through (a restart is left out: it would cost a
    # model load).
    if path == "/api/control/cache":
        for spelled in (path, "/api//control/cache", "/api/control/cache/"):
            r = Raw(keyed_server, "POST", spelled, body, auth(keyed_server.token))
            assert r.status == 202, (spelled, r.body)


def test_open_routes_stay_open_and_the_key_guards_v1_only(keyed_server):
    assert Raw(keyed_server, "GET", "//api/health").status == 200
    assert Raw(keyed_server, "GET", "/api/status").status == 200


# -- secrets in the log --------------------------------------------------------------------------


def test_no_secret_reaches_the_log(keyed_server):
    token = keyed_server.token
    with connect(f"{keyed_server.ws_url}?token={token}") as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "snapshot"
    with connect(keyed_server.ws_url, subprotocols=[f"headroom.token.{token}"]) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "snapshot"
    Raw(keyed_server, "GET", f"/v1/models?api_key={KEY}&token={token}")
    Raw(keyed_server, "GET", f"//v1/nothing?token={token}", headers=auth(KEY))
    deadline = time.monotonic() + 30
    while keyed_server.log().count("WebSocket") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = keyed_server.log()
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


def test_a_refused_origin_names_the_option_and_ollamas_origins_pass_its_routes(start_server):
    """A browser Origin not allowed is refused 403 in each API's shape, naming
    --cors-origin; Ollama's routes take the origins Ollama allows by default (a page on
    localhost), headroom's own routes and /v1 keep the strict list."""
    server = start_server(fake=True)
    local = {"Origin": "http://localhost:3000"}
    tags = ollama.Client(host=server.base_url, headers=local).list()
    assert [m.model for m in tags.models]
    answer = httpx.get(server.base_url + "/api/tags", headers=local)
    assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
    with pytest.raises(openai.PermissionDeniedError) as exc:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", default_headers=local, max_retries=0).models.list()
    assert "--cors-origin http://localhost:3000" in exc.value.body["message"]
    assert exc.value.body["code"] == "origin"
    with pytest.raises(anthropic.PermissionDeniedError) as exc:
        anthropic.Anthropic(base_url=server.base_url, api_key="x", default_headers=local, max_retries=0).messages.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.body["error"]["type"] == "permission_error"
    assert "--cors-origin http://localhost:3000" in exc.value.body["error"]["message"]
    status = httpx.get(server.base_url + "/api/status", headers=local)
    assert status.status_code == 403 and "--cors-origin" in status.json()["error"]["message"]
    evil = {"Origin": "https://evil.example/"}
    with pytest.raises(ollama.ResponseError) as exc:
        ollama.Client(host=server.base_url, headers=evil).chat(model="default", messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.status_code == 403 and "--cors-origin https://evil.example " in exc.value.error
    for origin in ("http://localhost.evil.example", "http://127.0.0.1.evil.example:80", "null"):
        assert httpx.get(server.base_url + "/api/tags", headers={"Origin": origin}).status_code == 403, origin
    for origin in ("http://127.0.0.1", "https://0.0.0.0:8080", "app://x", "vscode-webview://abc"):
        assert httpx.get(server.base_url + "/api/tags", headers={"Origin": origin}).status_code == 200, origin
