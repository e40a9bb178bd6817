"""Graceful shutdown of a real ``headroom serve`` (service.http.shutdown): SIGTERM, and SIGINT
to the whole process group as a terminal's Ctrl-C sends it, with a stream and a
non-streaming request in flight. New requests get 503 + Retry-After while the drain
runs; requests that finish in time finish; those past --shutdown-timeout end with an
OpenAI-shaped ``server_shutting_down`` error (an error event and ``[DONE]`` in a stream);
the service exits 0 with no worker left, no restart and no runtime file."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from service_harness import ServerProcess, process_gone
from test_service_cases import assert_openai_error
from test_service_events import recv, token_protocol
from test_service_restart import wait_for
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from service.events.schemas import CLOSE_GOING_AWAY

pytestmark = pytest.mark.slow

EXIT_TIMEOUT_S = 120.0


class InFlight:
    """One request run in a thread: a stream (its ``data:`` payloads) or a plain POST."""

    def __init__(self, server: ServerProcess, body: dict) -> None:
        self.server = server
        self.body = body
        self.events: list = []  # parsed JSON events, then "DONE"
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.server.base_url, timeout=300) as http:
                if not self.body.get("stream"):
                    self.response = http.post("/v1/chat/completions", json=self.body)
                    return
                with http.stream("POST", "/v1/chat/completions", json=self.body) as r:
                    self.response = r
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            data = line[len("data: ") :]
                            self.events.append("DONE" if data == "[DONE]" else json.loads(data))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def join(self) -> None:
        self.thread.join(EXIT_TIMEOUT_S)
        assert not self.thread.is_alive(), "the request never ended"
        assert self.error is None, repr(self.error)

    @property
    def content_chunks(self) -> int:
        return sum(
            1
            for e in self.events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
        )


def _body(max_tokens: int, *, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _start_both(server: ServerProcess, max_tokens: int) -> tuple[InFlight, InFlight]:
    """A stream and a non-streaming request, both running in the engine (the stream has
    produced text) before this returns."""
    stream = InFlight(server, _body(max_tokens, stream=True))
    plain = InFlight(server, _body(max_tokens, stream=False))
    wait_for(lambda: stream.content_chunks >= 2 or stream.error, 120, "the stream's first tokens")
    wait_for(lambda: server.health().json()["in_flight"] >= 2, 120, "both requests in flight")
    return stream, plain


def _assert_refused_while_draining(server: ServerProcess) -> None:
    """A new request during the drain: 503, Retry-After, ``server_shutting_down``."""

    def refused() -> httpx.Response | None:
        try:
            r = httpx.post(
                server.base_url + "/v1/chat/completions", json=_body(4, stream=False), timeout=30
            )
        except httpx.HTTPError:
            return None
        return r if r.status_code == 503 else None

    r = wait_for(refused, 60, "a 503 for a new request during the drain")
    error = assert_openai_error(r, 503, code="server_shutting_down")
    assert "shutting down" in error["message"]
    assert int(r.headers["Retry-After"]) >= 1
    health = server.health()
    assert health.status_code == 503 and health.json()["status"] == "stopped"


def _assert_clean_exit(server: ServerProcess, worker: int, runtime: Path) -> str:
    code = server.proc.wait(EXIT_TIMEOUT_S)
    log = server.log()
    assert code == 0, log
    wait_for(lambda: process_gone(worker), 30, "the worker to be gone")
    assert "restarting the worker" not in log, log
    assert "Traceback" not in log, log
    assert not [p for p in runtime.iterdir() if p.is_file()], list(runtime.iterdir())
    return log


def _assert_both_ended_with_the_shutdown_error(stream: InFlight, plain: InFlight) -> None:
    """The stream: an error event then ``[DONE]``; the other: a 503 JSON error."""
    stream.join()
    plain.join()
    assert stream.events[-1] == "DONE", stream.events[-3:]
    error = stream.events[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "server_shutting_down", error
    assert error["type"] == "server_error"
    assert plain.response is not None
    assert_openai_error(plain.response, 503, code="server_shutting_down")


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(start_server, tmp_path):
    server = start_server(
        ["--shutdown-timeout", "300"], {"HEADROOM_FAKE_STEP_S": "0.05"}, fake=True
    )
    worker = server.worker_pid()
    stream, plain = _start_both(server, max_tokens=120)
    server.proc.send_signal(signal.SIGTERM)
    _assert_refused_while_draining(server)
    stream.join()
    plain.join()
    # Both ran to their end: all 120 tokens, a finish_reason, [DONE].
    assert stream.events[-1] == "DONE"
    finish = [e["choices"][0]["finish_reason"] for e in stream.events[:-1] if e.get("choices")]
    assert finish[-1] == "length"
    assert stream.events[-2]["usage"]["completion_tokens"] == 120
    assert plain.response is not None and plain.response.status_code == 200, plain.response
    assert plain.response.json()["usage"]["completion_tokens"] == 120
    log = _assert_clean_exit(server, worker, tmp_path / "runtime")
    assert "shutting down" in log


def test_sigterm_ends_requests_past_the_deadline_with_an_error(start_server, tmp_path):
    server = start_server(["--shutdown-timeout", "1"], {"HEADROOM_FAKE_STEP_S": "0.05"}, fake=True)
    worker = server.worker_pid()
    stream, plain = _start_both(server, max_tokens=1500)  # over a minute of steps
    server.proc.send_signal(signal.SIGTERM)
    _assert_both_ended_with_the_shutdown_error(stream, plain)
    log = _assert_clean_exit(server, worker, tmp_path / "runtime")
    # The non-streaming request is logged with the status it was answered with.
    plain_id = [line for line in log.splitlines() if "status=503" in line]
    assert len(plain_id) >= 2, log  # the stream's and the non-streaming request's lines
    assert "status=500" not in log and "status=200" not in log, log


def test_ctrl_c_to_the_process_group_drains_and_exits_0(start_server, tmp_path):
    """SIGINT to the whole group (service and worker), real engine: the worker ignores
    it, the service drains, ends what is past the deadline, stops the worker, exits 0."""
    server = start_server(["--shutdown-timeout", "2"], new_session=True)
    worker = server.worker_pid()
    assert os.getpgid(worker) == server.proc.pid  # the worker shares the group
    stream, plain = _start_both(server, max_tokens=1000)
    os.killpg(server.proc.pid, signal.SIGINT)
    _assert_both_ended_with_the_shutdown_error(stream, plain)
    log = _assert_clean_exit(server, worker, tmp_path / "runtime")
    assert "KeyboardInterrupt" not in log, log
    assert "SIGINT: shutting down" in log, log


def test_sigterm_closes_the_event_socket_with_going_away(start_server, tmp_path):
    """The desktop app's event socket learns that the service stops: close code 1001
    with the hub's reason, as service.control.socket documents, not uvicorn's own 1012
    (Service Restart, no reason), which it sent when its shutdown closed the socket first."""
    server = start_server([], fake=True)
    worker = server.worker_pid()
    with connect(server.ws_url, subprotocols=token_protocol(server)) as ws:
        assert recv(ws)["type"] == "snapshot"
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=60)
        assert ws.close_code == CLOSE_GOING_AWAY, (ws.close_code, ws.close_reason)
        assert ws.close_reason == "the service is stopping"
    _assert_clean_exit(server, worker, tmp_path / "runtime")
