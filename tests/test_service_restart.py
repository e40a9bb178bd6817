"""The worker's life and death, and clean start-up failures, with real server processes:
the worker killed (stream error, 503 + Retry-After, back to 200), the service killed
(no worker left), hung worker (a stuck step, a stopped process; a long step is none),
crash loop, retry of requests that had no token yet, the port taken, missing model, API
key, custom CORS schemes in the config."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import pytest
from service_harness import ServerProcess, headroom_command, process_gone
from service_harness import wait_for as harness_wait_for
from test_service_cases import assert_openai_error
from test_service_openai import QUESTION, sse_events

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout_s: float, what: str):
    return harness_wait_for(predicate, timeout_s, what, interval_s=0.05)


def health_status(server: ServerProcess) -> tuple[int, dict]:
    r = server.health()
    return r.status_code, r.json()


def kill_mid_stream(http: httpx.Client, path: str, body: dict, worker: int, chunks: int) -> tuple[list, float]:
    """Stream ``body`` to ``path`` and SIGKILL ``worker`` once ``chunks`` data lines came;
    the rest of the stream's events (:func:`sse_events`) and the seconds they took."""
    with http.stream("POST", path, json=body) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= chunks:
                break
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        rest = sse_events(list(lines))
        return rest, time.monotonic() - killed_at


# -- the worker SIGKILLed mid-stream ----------------------------------------------------------------


def test_c08_worker_killed_during_stream(start_server):
    server = start_server()
    worker = server.worker_pid()
    body = {
        "messages": QUESTION,
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        rest, ended_s = kill_mid_stream(http, "/v1/chat/completions", body, worker, 3)  # role chunk, two tokens
        assert ended_s < 2.0
        assert rest[-1] == "DONE"
        assert rest[-2]["error"]["code"] == "engine_restarted"
        assert set(rest[-2]["error"]) == {"message", "type", "param", "code"}

        status, report = health_status(server)
        assert status == 503
        assert report["status"] == "restarting"
        assert report["last_exit"]["signal"] == "SIGKILL"

        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4})
        assert_openai_error(r, 503, code="engine_restarting")
        assert int(r.headers["retry-after"]) >= 1
        assert server.health().headers.get("retry-after")

        wait_for(lambda: server.health().status_code == 200, 120, "the worker to come back")
        assert server.worker_pid() != worker
        r = http.post(
            "/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        assert server.health().json()["restarts"] == 1

    # SIGKILL the service itself: its worker must not outlive it.
    worker = server.worker_pid()
    server.proc.kill()
    server.proc.wait()
    wait_for(lambda: process_gone(worker), 30, f"worker {worker} to die with its parent")


# -- the fake engine: hung worker, retry once, crash loop ------------------------------------------

HANG_ONCE_SEED, HANG_ALWAYS_SEED = 777, 778  # see fake_engine.py


def test_hung_worker_is_killed_and_requests_without_tokens_retried_once(tmp_path, start_server):
    server = start_server(
        # The second request must reach the supervisor before the hung worker is killed:
        # a stall timeout of seconds leaves room for that on a busy machine.
        ["--stall-timeout-s", "6", "--heartbeat-interval-s", "0.1"],
        {"HEADROOM_FAKE_MARKER": str(tmp_path / "hung-once")},
        fake=True,
    )
    results: dict[str, httpx.Response] = {}

    def send(name: str, seed: int | None) -> None:
        results[name] = httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": "hello there", "max_tokens": 3, "seed": seed},
            timeout=60,
        )

    def run(*requests: tuple[str, int | None]) -> None:
        threads = []
        for name, seed in requests:
            in_flight = server.health().json()["in_flight"]
            threads.append(threading.Thread(target=send, args=(name, seed)))
            threads[-1].start()
            # The worker has it (the first one is stuck in a step) before the next goes.
            wait_for(
                lambda n=in_flight: server.health().json()["in_flight"] > n,
                60,
                f"{name!r} in flight",
            )
        for thread in threads:
            thread.join(timeout=120)

    # Both had no token when the hung worker was killed: both retried, both served.
    run(("hangs once", HANG_ONCE_SEED), ("normal", None))
    for name in ("hangs once", "normal"):
        assert results[name].status_code == 200, results[name].text
        assert results[name].json()["usage"]["completion_tokens"] == 3
    # The step hung; the worker's heartbeat thread beat on with a counter that stood still.
    assert "made no progress" in server.log()
    assert server.health().json()["restarts"] == 1

    # Retried once only: one that hangs every worker fails after the second.
    run(("hangs always", HANG_ALWAYS_SEED))
    assert_openai_error(results["hangs always"], 503, code="engine_restarted")
    wait_for(lambda: server.health().status_code == 200, 30, "ready again")
    assert server.health().json()["restarts"] == 3


def test_a_worker_killed_under_timed_requests_ends_or_retries_them_and_the_restart_is_not_their_time(
        tmp_path, start_server):
    """``--request-timeout 3`` and a worker SIGKILLed under requests, each load after the
    first taking 4 s (longer than the timeout): a stream that had tokens ends at once with
    ``engine_restarted`` (not ``request_timeout``); a request with no token yet is sent
    again to the next worker and answered (the restart is not its time); after the
    restart the clock runs again: a request that hangs gets its 504."""
    load_s = tmp_path / "load_s"
    server = start_server(["--request-timeout", "3"], fake=True, env={
        "HEADROOM_FAKE_LOAD_S": f"@{load_s}", "HEADROOM_FAKE_MARKER": str(tmp_path / "hung-once"),
        "HEADROOM_FAKE_STEP_S": "0.05"})
    load_s.write_text("4")
    worker = server.worker_pid()
    body = {"prompt": "hello there", "max_tokens": 2000, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        rest, _ = kill_mid_stream(http, "/v1/completions", body, worker, 2)
        assert rest[-1] == "DONE" and rest[-2]["error"]["code"] == "engine_restarted", rest
        server.wait_ready(120)

        # No token yet when their worker is killed: one hangs the first worker it meets (its
        # seed), a stream waits behind it.
        worker, results = server.worker_pid(), {}

        def stream() -> None:
            chat = {"messages": QUESTION, "max_tokens": 3, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=chat) as r:
                results["stream"] = sse_events(r.iter_lines())

        threads = [threading.Thread(target=lambda: results.update(plain=http.post(
            "/v1/completions", json={"prompt": "hello there", "max_tokens": 3, "seed": HANG_ONCE_SEED})))]
        threads[0].start()
        wait_for(lambda: (tmp_path / "hung-once").exists(), 60, "the request to hang its worker")
        threads.append(threading.Thread(target=stream))
        threads[1].start()
        wait_for(lambda: server.health().json()["in_flight"] == 2, 60, "the stream in flight")
        os.kill(worker, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=120)
        assert results["plain"].status_code == 200, results["plain"].text
        assert results["plain"].json()["usage"]["completion_tokens"] == 3
        events = results["stream"]
        assert events[-1] == "DONE" and not [e for e in events[:-1] if "error" in e], events
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert server.worker_pid() != worker
        assert server.log().count("on the new worker") == 2 and "request_timeout" not in server.log()

        hung = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3, "seed": HANG_ALWAYS_SEED})
        assert_openai_error(hung, 504, code="request_timeout")


def test_a_stopped_worker_is_killed_and_restarted(start_server):
    """SIGSTOP: no thread of the worker runs, no heartbeat comes; killed after the stall
    timeout and restarted."""
    server = start_server(["--stall-timeout-s", "3", "--heartbeat-interval-s", "0.1"], fake=True)
    worker = server.worker_pid()
    os.kill(worker, signal.SIGSTOP)
    wait_for(lambda: process_gone(worker), 60, "the stopped worker to be killed")
    assert "sent no heartbeat" in server.log()
    # Its exit says why, not only the signal (a stream it carried is told the same).
    wait_for(lambda: "was killed by SIGKILL (hung: it sent no heartbeat for" in server.log(), 30, "the exit's cause")
    assert "past the stall timeout of 3 s)" in server.log()
    wait_for(lambda: (r := server.health()).status_code == 200 and r.json()["worker_pid"] != worker, 60, "a new worker")
    assert server.health().json()["restarts"] == 1
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_long_step_is_not_a_stall(start_server):
    """A 10 s step (the ``slow`` fault) under a 4 s stall timeout, two and a half times
    as long: its counter moves on as it computes and the heartbeat thread carries it, so
    the same worker answers."""
    server = start_server(["--stall-timeout-s", "4"], {"HEADROOM_FAULTS": "slow:*:1:10"})
    worker = server.worker_pid()
    with server.client(timeout=300) as http:
        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    log = server.log()
    assert "the slow step of 10.0 s is over" in log  # the step did take 10 s
    assert "killing it" not in log
    assert server.worker_pid() == worker
    assert server.health().json()["restarts"] == 0


def test_crash_loop_goes_to_failed_and_says_why(start_server):
    server = start_server(["--max-restarts", "3"], fake=True)
    for _ in range(3):
        wait_for(lambda: server.health().status_code == 200, 30, "ready")
        os.kill(server.worker_pid(), signal.SIGKILL)
        wait_for(lambda: server.health().status_code == 503, 60, "not ready")
    status, report = wait_for(
        lambda: (s := health_status(server))[1]["status"] == "failed" and s, 10, "failed"
    )
    assert status == 503
    assert "crash loop" in report["reason"]
    assert report["last_exit"]["signal"] == "SIGKILL"
    assert isinstance(report["last_exit"]["last_lines"], list)
    r = httpx.post(
        server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
    )
    error = assert_openai_error(r, 503, code="engine_failed")
    assert "crash loop" in error["message"]
    # It stays failed, no restart: the supervisor decides between planning a restart
    # (logged "restarting the worker in") and failing in the one handler of a worker's
    # exit, so once the failure is logged the planned restarts are the two before it,
    # both done (restarts 2), and none is pending.
    wait_for(lambda: "engine failed: crash loop" in server.log(), 30, "the failure logged")
    assert server.log().count("restarting the worker in") == 2
    report = server.health().json()
    assert report["status"] == "failed" and report["restarts"] == 2
    assert report["worker_pid"] is None and "retry_after_s" not in report
    assert server.proc.poll() is None  # the front end is up
    # Every message of the failed state names the way out, and a resume is no way out.
    restart = "POST /api/control/restart (or restarting the service) starts it again"
    assert restart in report["reason"] and restart in error["message"]
    control = {"Authorization": f"Bearer {server.token}"}
    resumed = httpx.post(server.base_url + "/api/control/resume", headers=control, timeout=30)
    assert restart in assert_openai_error(resumed, 409, code="engine_failed")["message"]
    # Nor is a pause: it turned failed into paused, whose resume then started the worker.
    paused = httpx.post(server.base_url + "/api/control/pause", headers=control, timeout=30)
    assert restart in assert_openai_error(paused, 409, code="engine_failed")["message"]
    assert server.health().json()["status"] == "failed"
    assert httpx.post(server.base_url + "/api/control/restart", headers=control, timeout=30).status_code == 202
    server.wait_ready(60)


def test_crash_loop_at_first_start_exits_with_the_reason(start_server):
    server = start_server(
        ["--max-restarts", "3"], {"HEADROOM_FAKE_CRASH_AT_LOAD": "1"}, fake=True, wait=False
    )
    code = server.proc.wait(timeout=60)
    log = server.log()
    assert code != 0
    assert "crash loop" in log
    assert "exited with code 7" in log
    assert "[worker" in log and "crashing at load on purpose" in log  # captured output


def test_load_failure_exits_non_zero_naming_the_problem(start_server):
    server = start_server(
        env={"HEADROOM_FAKE_LOAD_ERROR": "/no/such/model does not exist"}, fake=True, wait=False
    )
    code = server.proc.wait(timeout=60)
    assert code != 0
    assert "/no/such/model does not exist" in server.log()


def test_a_model_file_damaged_after_the_first_load_fails_at_once_naming_it(tmp_path, start_server):
    """A GGUF truncated while served (a re-download over it), then a worker restart: the
    load's CorruptWeights was retried five times, then the service answered 503 "crash
    loop: the worker exited 5 times in 60 s; last: exited with code 3", naming neither the
    file nor what is wrong. A load error of the model itself fails at once with its words."""
    damage = tmp_path / "damage"
    server = start_server(env={"HEADROOM_FAKE_LOAD_ERROR": f"@{damage}"}, fake=True)
    damage.write_text("/models/x.gguf is not a readable GGUF file (it is truncated); download it again")
    os.kill(server.worker_pid(), signal.SIGKILL)
    status, report = wait_for(
        lambda: (s := health_status(server))[1]["status"] == "failed" and s, 30, "failed"
    )
    assert status == 503 and report["restarts"] == 1
    assert "CorruptWeights: /models/x.gguf is not a readable GGUF file" in report["reason"]
    assert "crash loop" not in report["reason"]
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert "/models/x.gguf is not a readable GGUF file" in assert_openai_error(r, 503, code="engine_failed")["message"]


# -- clean start-up failures ---------------------------------------------------------------------------


def run_serve(args: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*headroom_command(), "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        # A folder of its own for the single-instance lock: a service the user runs
        # must not make this one refuse to start.
        env={**os.environ, "HEADROOM_CONFIG": os.devnull, "HEADROOM_RUNTIME_DIR": tempfile.mkdtemp()},
    )


def test_c10_port_in_use_fails_fast(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve(["--port", str(port)])
    assert result.returncode != 0
    assert f"port {port} is in use" in result.stderr
    assert "pass --port N (or set HEADROOM_PORT)" in result.stderr  # the fix, named
    assert "listening" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("host", ["999.1.1.1", "192.0.2.1"])  # no address; TEST-NET-1, not this machine's
def test_a_host_that_is_not_this_machines_fails_naming_the_flag(host):
    """Where the bare resolver's "Name or service not known" (or the bind's "Cannot assign
    requested address") was the whole message."""
    result = run_serve(["--port", "0", "--host", host])
    assert result.returncode == 2, result.stderr  # the setting is wrong, as any other bad value
    assert result.stderr.startswith(f"headroom: error: --host {host}: not an address of this machine ("), result.stderr
    assert "give --host an address of this machine, such as 127.0.0.1 (the default)" in result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stderr


def test_settings_only_a_gpu_uses_are_noted_on_the_cpu():
    """``--cpu-layers N`` and ``--device-limit`` with ``--device cpu`` have no effect (as
    ``headroom plan`` says): serve says so in a line before it goes on (here to a host it
    then refuses, so that nothing loads)."""
    result = run_serve(["--port", "0", "--device", "cpu", "--cpu-layers", "2", "--device-limit", "2GiB",
                        "--host", "999.1.1.1"])
    assert ("headroom: note: --cpu-layers 2 and --device-limit 2.00 GiB: no effect on the CPU (every layer runs "
            "there already") in result.stderr, result.stderr
    assert result.returncode == 2 and "--host 999.1.1.1" in result.stderr


def test_missing_model_fails_naming_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_serve(["--port", "0", "--model", str(missing)])
    assert result.returncode != 0
    assert str(missing) in result.stderr


def test_bad_setting_fails_naming_its_source(tmp_path):
    result = subprocess.run(
        [*headroom_command(), "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HEADROOM_CONFIG": os.devnull, "HEADROOM_PORT": "eighty"},
    )
    assert result.returncode == 2
    assert "HEADROOM_PORT" in result.stderr


# -- API key and configured origins ---------------------------------------------------------------------


def test_api_key_required_on_v1_only(start_server):
    server = start_server(["--api-key", "sekrit"], fake=True)
    url = server.base_url
    assert_openai_error(httpx.get(url + "/v1/models"), 401, code="invalid_api_key")
    bad = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert_openai_error(bad, 401, code="invalid_api_key")
    ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert httpx.get(url + "/api/health").status_code == 200
    # A preflight never needs the key.
    r = httpx.request(
        "OPTIONS",
        url + "/v1/chat/completions",
        headers={"Origin": "tauri://localhost", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 204
    # The official client sends it as a bearer token.
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="sekrit")
    assert client.models.list().data[0].id == "fake-model"


def test_api_key_from_environment(start_server):
    server = start_server(env={"HEADROOM_API_KEY": "from-env"}, fake=True)
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer from-env"})
    assert r.status_code == 200


def test_c19_custom_schemes_in_config_never_crash(tmp_path, start_server):
    config = tmp_path / "custom.toml"
    config.write_text(
        'cors_origin = ["myapp://localhost", "x-weird+scheme://a b/", "::::", '
        '"http://[bad", "null", "HTTP://Example.COM:8080/"]\n'
    )
    server = start_server(["--config", str(config)], fake=True)
    for origin, allowed in [
        ("myapp://localhost", True),
        ("x-weird+scheme://a b", True),
        ("http://example.com:8080", True),
        ("null", True),
        ("tauri://localhost", True),
        ("myapp://elsewhere", False),
        ("http://[bad", True),
    ]:
        r = httpx.get(server.base_url + "/api/health", headers={"Origin": origin})
        if allowed:
            assert r.status_code == 200, origin
            assert r.headers["access-control-allow-origin"] == origin
        else:
            assert r.status_code == 403, origin
    assert server.proc.poll() is None
    assert json.loads(httpx.get(server.base_url + "/api/health").text)["status"] == "ready"


def test_worker_never_imports_the_web_stack(start_server):
    server = start_server(
        env={"HEADROOM_ENGINE_FACTORY": "fake_engine:ImportProbe"}, fake=True, wait=False
    )
    assert server.proc.wait(timeout=60) != 0
    assert "service packages in the worker: none" in server.log()
