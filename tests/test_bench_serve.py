"""``headroom bench serve`` refusing what cannot run, with exit 2 and one line naming the
fix, and reporting the concurrency it really used: against ``headroom serve`` with the
fake engine (tests/fake_engine.py, a context of 2048 tokens), so no model loads."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from service.cli.commands import main


def invoke(args: list[str]):
    return CliRunner().invoke(main, ["bench", "serve", "--no-engine", *args], env={"HEADROOM_CONFIG": os.devnull})


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory, default_model_dir):
    from service_harness import ServerProcess, serving

    yield from serving(ServerProcess(tmp_path_factory.mktemp("bench-serve"), fake=True,
                                     fake_model_dir=default_model_dir))


def test_concurrency_above_the_requests_is_reported_as_the_requests(fake_server):
    result = invoke(["--url", fake_server.base_url, "-n", "2", "-c", "50", "--max-tokens", "2",
                     "--prompt-words", "8"])
    assert result.exit_code == 0, result.output
    assert "2 requests, 2 at a time" in result.output


def test_client_processes_split_the_requests_and_measure_them_all(fake_server):
    """``--client-processes 3``: 7 requests, 5 at a time, dealt out over three spawned
    client processes (2, 2 and 1 at a time); every request's tokens are counted (the
    table's rate is the tokens over the wall time, the requests' rate the requests over
    it), the same as with one process. A prompt over the context from a process is the
    same one-line refusal."""
    import re

    rows = {}
    for processes in ("1", "3"):
        result = invoke(["--url", fake_server.base_url, "-n", "7", "-c", "5", "--max-tokens", "6",
                         "--prompt-words", "8", "--client-processes", processes])
        assert result.exit_code == 0, result.output
        assert "7 requests, 5 at a time" in result.output
        row = next(line for line in result.output.splitlines() if line.startswith("service (HTTP"))
        rows[processes] = row
        tok_s, req_s = (float(x) for x in re.findall(r"[\d.]+", row)[-2:])
        assert tok_s == pytest.approx(6 * req_s, rel=0.02)  # 6 tokens a request, all 7 counted
    assert rows["3"].startswith("service (HTTP, 3 client processes)") and rows["1"].startswith("service (HTTP) ")
    result = invoke(["--url", fake_server.base_url, "-n", "2", "--max-tokens", "1000", "--prompt-words", "2000",
                     "--client-processes", "2"])
    assert result.exit_code == 2 and "lower --prompt-words or --max-tokens" in result.output, result.output


@pytest.mark.parametrize(("cores", "concurrency", "processes"), [(2, 64, 1), (16, 64, 4), (16, 8, 1), (16, 200, 13),
                                                                  (1, 5, 1)])
def test_the_client_takes_a_process_per_16_streams_within_the_cores(cores, concurrency, processes):
    from service.bench.serve import auto_client_processes

    assert auto_client_processes(concurrency, cores) == processes


def test_without_url_it_finds_the_service_on_the_configured_port(fake_server, tmp_path):
    """No --url: the running service's address (its runtime.json), else the configured
    port (HEADROOM_PORT here; this runtime folder knows no service)."""
    env = {"HEADROOM_CONFIG": os.devnull, "HEADROOM_PORT": str(fake_server.port),
           "HEADROOM_RUNTIME_DIR": str(tmp_path)}
    result = CliRunner().invoke(main, ["bench", "serve", "--no-engine", "-n", "1", "--max-tokens", "2",
                                       "--prompt-words", "8"], env=env)
    assert result.exit_code == 0, result.output
    assert "1 requests, 1 at a time" in result.output, result.output


@pytest.mark.parametrize(("args", "needle"), [
    (["-c", "-3"], "Invalid value for '-c' / '--concurrency': -3 is not in the range x>=1"),
    (["-c", "0"], "Invalid value for '-c' / '--concurrency': 0 is not in the range x>=1"),
    (["--prompt-words", "-5"], "Invalid value for '--prompt-words': -5 is not in the range x>=1"),
])
def test_counts_below_one_are_refused(args, needle):
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/api/health"])
def test_a_url_with_a_path_names_the_service_root(suffix):
    result = invoke(["--url", f"http://127.0.0.1:1{suffix}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"headroom: error: --url http://127.0.0.1:1{suffix} looks wrong: give the headroom service's "
        "root, http://127.0.0.1:1, without /v1 or any other path (the benchmark adds the API's paths)")


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1:abc",
                                 "http://:8427"])
def test_a_url_without_a_valid_host_and_port_is_refused_at_once(url):
    # 99999 was tried as a connection and reported as "connection refused".
    result = invoke(["--url", url])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"headroom: error: --url {url!r} has no valid host and port; give e.g. "
                                     "http://127.0.0.1:8427")


def test_a_prompt_over_the_context_is_one_line_naming_the_flags(fake_server):
    result = invoke(["--url", fake_server.base_url, "-n", "1", "--max-tokens", "2",
                     "--prompt-words", "3000"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("headroom: error: a ~3000-word prompt"), result.output
    assert "the server's context of 2048 tokens" in lines[0]
    assert lines[0].endswith("lower --prompt-words or --max-tokens")


def test_max_tokens_over_the_context_is_refused_before_any_request(fake_server):
    result = invoke(["--url", fake_server.base_url, "-n", "1", "--max-tokens", "5000"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "headroom: error: --max-tokens 5000 leaves no room for a prompt in the server's context "
        "of 2048 tokens: give --max-tokens below 2048")


def test_a_root_that_is_no_headroom_service_says_the_url_looks_wrong(tmp_path):
    """Something else answers on the port (here a plain file server): its 404 for
    /api/health names --url, not "the server is not ready"."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = invoke(["--url", f"http://127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()
    assert result.exit_code == 2, result.output
    assert "/api/health answered 404: --url looks wrong" in result.stderr
    assert "not ready" not in result.output
