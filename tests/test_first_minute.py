"""A new user's first minute with ``headroom serve``: where the dashboard is, what ``/``
answers, the page's headers, a restart asked for by hand told apart from a crash, and
the host's memory shown in CPU mode.

The servers here run the fake engine (tests/fake_engine.py): these are the service's
answers, not the engine's.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import httpx
import pytest
from service_harness import ServerProcess, serving, wait_for
from websockets.sync.client import connect

from service.common.token import dashboard_url
from service.control.actions import RESTART_REASON
from service.vram.host import host_memory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    proc = ServerProcess(
        tmp_path_factory.mktemp("first-minute"), fake=True, fake_model_dir=default_model_dir
    )
    yield from serving(proc)


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def test_dashboard_url_brackets_ipv6_and_names_loopback_for_a_wildcard():
    assert dashboard_url("127.0.0.1", 8427) == "http://127.0.0.1:8427/ui/"
    assert dashboard_url("0.0.0.0", 1, "tok") == "http://127.0.0.1:1/ui/#token=tok"
    assert dashboard_url("::1", 2) == "http://[::1]:2/ui/"


def test_host_memory_counts_this_process():
    mem = host_memory([os.getpid(), 2**22 + 7])  # a pid that cannot exist counts 0
    assert 0 < mem.available_bytes <= mem.total_bytes
    assert 0 < mem.ours_bytes < mem.total_bytes


def test_ready_log_names_the_dashboard_and_never_the_token(server):
    line = wait_for(
        lambda: next((x for x in server.log().splitlines() if "headroom ready" in x), None),
        60,
        "the ready line",
    )
    assert f"dashboard at http://127.0.0.1:{server.port}/ui/ " in line
    assert "headroom token" in line
    assert server.token not in server.log()


def test_ready_line_on_a_terminal_carries_the_token_link(monkeypatch, capsys, tmp_path):
    from service.cli.serve import _announce_dashboard_when_ready
    from service.common.token import load_or_create_token

    monkeypatch.setenv("HEADROOM_CONFIG_DIR", str(tmp_path))
    token = load_or_create_token()

    class Sup:
        on_first_ready = None

    sup = Sup()
    _announce_dashboard_when_ready(sup, "127.0.0.1", 9)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    sup.on_first_ready()
    assert f"http://127.0.0.1:9/ui/#token={token}" in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    sup.on_first_ready()  # a log file (a login service's) never gets the token
    assert token not in capsys.readouterr().err


@pytest.mark.usefixtures("built_dashboard")
def test_root_sends_a_person_to_the_dashboard(server):
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    r = httpx.get(server.base_url + "/", headers=browser, follow_redirects=False)
    assert r.status_code in (301, 302, 307, 308) and r.headers["location"] == "/ui/"
    r = httpx.get(server.base_url + "/", headers=browser, follow_redirects=True)
    assert r.status_code == 200 and "app.js" in r.text
    # Any other client (Ollama's ping) learns that the server runs.
    r = httpx.get(server.base_url + "/", follow_redirects=False)
    assert r.status_code == 200 and r.text == "headroom is running"
    # Not part of the API's document.
    assert "/" not in httpx.get(server.base_url + "/schema/openapi.json").json()["paths"]


@pytest.mark.usefixtures("built_dashboard")
@pytest.mark.parametrize("path", ["/ui/", "/ui/app.js"])
def test_dashboard_files_say_their_charset_once(server, path):
    r = httpx.get(server.base_url + path)
    assert r.status_code == 200
    types = r.headers.get_list("content-type")
    assert len(types) == 1 and types[0].lower().count("charset") == 1, types


def _exit_after(server, act) -> dict:
    """Run ``act()`` while following the socket; the worker's exit it caused, once the
    service is ready again."""
    exited = None
    with connect(server.ws_url, subprotocols=[f"headroom.token.{server.token}"]) as ws:
        json.loads(ws.recv(timeout=60))  # the snapshot
        act()
        while True:
            event = json.loads(ws.recv(timeout=120))
            if event["type"] == "worker" and event["phase"] == "exited":
                exited = event
            if exited and event["type"] == "health" and event["status"] == "ready":
                return exited


def test_restart_from_the_control_api_says_who_asked_and_a_kill_does_not(server):
    old = server.worker_pid()
    url = server.base_url + "/api/control/restart"
    asked = _exit_after(server, lambda: httpx.post(url, headers=auth(server)).raise_for_status())
    assert asked["pid"] == old and asked["signal"] == "SIGKILL"
    assert asked["reason"] == f"was killed by SIGKILL: {RESTART_REASON}"
    wait_for(
        lambda: f"worker {old} was killed by SIGKILL: {RESTART_REASON}" in server.log(),
        30,
        "the log line",
    )

    # A kill nobody asked for through the API reads as the crash it is.
    pid = server.worker_pid()
    crash = _exit_after(server, lambda: os.kill(pid, signal.SIGKILL))
    assert crash["pid"] == pid and crash["reason"] == "was killed by SIGKILL"
    status = httpx.get(server.base_url + "/api/status").json()
    assert status["last_exit"]["reason"] == "was killed by SIGKILL"


def test_cpu_mode_vram_events_carry_the_hosts_memory(server):
    vram = httpx.get(server.base_url + "/api/status").json()["vram"]
    if vram["source"] != "none":
        pytest.skip("a GPU is visible here: the vram events describe it, not the host")
    assert "CPU mode" in vram["reason"]

    def host_sample():
        v = httpx.get(server.base_url + "/api/status").json()["vram"]
        return v if v.get("host") and v["host"]["ours_bytes"] > 0 else None

    v = wait_for(host_sample, 60, "a vram event with the host's memory")
    host = v["host"]
    assert 0 < host["available_bytes"] <= host["total_bytes"]
    # The service and its worker are resident: more than this test's own interpreter
    # needs to import httpx.
    assert host["ours_bytes"] > 10 * 2**20
    seq = v["seq"]
    wait_for(
        lambda: httpx.get(server.base_url + "/api/status").json()["vram"]["seq"] > seq,
        30,
        "a newer host sample (they repeat about once a second)",
    )


def test_an_unknown_route_or_method_answers_in_the_shape_of_its_api(server):
    """Ollama's clients read ``{"error": "..."}``: a route this server lacks under
    ``/api``, one of Ollama's it does not serve (``/api/pull``: 501 naming the way) and
    a wrong method on one of Ollama's routes answer so; ``/v1`` and headroom's own
    ``/api`` routes keep OpenAI's shape."""
    for method, path, status in (("POST", "/api/pull", 501), ("POST", "/api/embed", 501), ("POST", "/api/nope", 404),
                                 ("GET", "/api/chat", 405)):
        r = httpx.request(method, server.base_url + path)
        assert r.status_code == status and isinstance(r.json()["error"], str), (path, r.text)
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405),
                                 ("POST", "/api/health", 405)):
        r = httpx.request(method, server.base_url + path)
        assert r.status_code == status and isinstance(r.json()["error"]["message"], str), (path, r.text)
