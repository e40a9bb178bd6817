"""``headroom doctor``, ``serve --log-file`` (rotation, the user log folder) and the
runtime folder chosen without platformdirs' warning when XDG_RUNTIME_DIR is unset."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import fake_systemctl, free_port, wait_for

from engine.common.units import MiB
from service.cli.commands import main
from service.cli.logfile import BACKUP_COUNT, MAX_BYTES, setup_logging

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def doctor_env(tmp_path, monkeypatch) -> dict[str, str]:
    """An empty config, a fresh config folder, a free port, no running headroom and a
    systemd user instance that answers, in a temporary home."""
    config = tmp_path / "config.toml"
    config.write_text("")
    env = {
        "HEADROOM_CONFIG": str(config),
        "HEADROOM_CONFIG_DIR": str(tmp_path / "cfg"),
        "HEADROOM_PORT": str(free_port()),
        "HEADROOM_RUNTIME_DIR": str(tmp_path / "run"),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg-config"),
        "PATH": fake_systemctl(tmp_path / "bin", 0),
    }
    return env


def doctor(env: dict[str, str]):
    result = CliRunner().invoke(main, ["doctor"], env=env)
    lines = {}
    for line in result.output.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] in ("OK", "WARN", "FAIL"):
            lines[parts[1]] = (parts[0], line)
    return result, lines


def test_doctor_passes_on_a_working_installation(doctor_env):
    result, lines = doctor(doctor_env)
    assert result.exit_code == 0, result.output
    for name in ("headroom", "config", "torch", "kernels", "model", "port", "token", "service"):
        assert lines[name][0] == "OK", result.output
    assert lines["driver"][0] in ("OK", "WARN")  # WARN: no NVIDIA driver (a CPU machine)
    assert "is free" in lines["port"][1]
    assert "not installed" in lines["service"][1]


def test_doctor_fails_with_the_fix(doctor_env, tmp_path):
    Path(doctor_env["HEADROOM_CONFIG"]).write_text("port = [not toml")
    token = Path(doctor_env["HEADROOM_CONFIG_DIR"]) / "token"
    token.parent.mkdir()
    token.write_text("a" * 43 + "\n")
    token.chmod(0o644)
    result, lines = doctor(doctor_env)
    assert result.exit_code == 1
    assert lines["config"][0] == "FAIL" and "not valid TOML" in lines["config"][1]
    assert f"fix: correct or remove {doctor_env['HEADROOM_CONFIG']}" in result.output
    assert lines["token"][0] == "FAIL" and f"fix: chmod 600 {token}" in result.output

    Path(doctor_env["HEADROOM_CONFIG"]).write_text("")
    token.chmod(0o600)
    with socket.socket() as other:  # another program on the port
        other.bind(("127.0.0.1", int(doctor_env["HEADROOM_PORT"])))
        other.listen()
        result, lines = doctor(doctor_env)
    assert result.exit_code == 1
    assert lines["port"][0] == "FAIL" and "in use by another program" in lines["port"][1]
    assert "fix: stop it, or set another port" in result.output


@pytest.mark.parametrize(
    ("variable", "value"), [("HEADROOM_PORT", "abc"), ("HEADROOM_RESERVE", "lots"),
     ("HEADROOM_STALL_TIMEOUT_S", "0.001")]
)
def test_doctor_names_the_variable_a_bad_value_came_from(doctor_env, variable, value):
    """A bad ``HEADROOM_*`` value was answered 'fix: correct or remove <config file>',
    a file that held nothing wrong (or did not exist): the fix names the variable."""
    Path(doctor_env["HEADROOM_CONFIG"]).unlink()
    del doctor_env["HEADROOM_CONFIG"]
    doctor_env[variable] = value
    result, lines = doctor(doctor_env)
    assert result.exit_code == 1
    assert lines["config"][0] == "FAIL" and variable in lines["config"][1], result.output
    assert f"fix: correct or unset {variable}" in result.output, result.output
    assert "correct or remove" not in result.output, result.output


def test_doctor_asks_the_headroom_that_listens(doctor_env, start_server):
    server = start_server(fake=True)
    doctor_env["HEADROOM_PORT"] = str(server.port)
    result, lines = doctor(doctor_env)
    assert lines["port"] == ("OK", lines["port"][1]), result.output
    assert f"headroom answers on 127.0.0.1:{server.port}: ready" in lines["port"][1]


def test_doctor_and_token_find_the_running_service_on_its_own_port(doctor_env, start_server):
    """The service runs on another port than the configured one: doctor reports its
    health and `headroom token` its dashboard, both where `headroom status` finds it."""
    server = start_server(fake=True)
    doctor_env["HEADROOM_RUNTIME_DIR"] = server.env["HEADROOM_RUNTIME_DIR"]
    result, lines = doctor(doctor_env)
    assert lines["port"][0] == "OK", result.output
    assert f"on 127.0.0.1:{server.port}" in lines["port"][1] and "answers: ready" in lines["port"][1]
    assert f"(the config says port {doctor_env['HEADROOM_PORT']})" in lines["port"][1]
    assert f"(pid {server.proc.pid})" in lines["port"][1]

    shown = CliRunner().invoke(main, ["token"], env=doctor_env)
    assert shown.exit_code == 0, shown.output
    assert f"http://127.0.0.1:{server.port}/ui/#token={server.token}" in shown.output

    server.stop()  # none runs: the configured port again
    shown = CliRunner().invoke(main, ["token"], env=doctor_env)
    assert f"http://127.0.0.1:{doctor_env['HEADROOM_PORT']}/ui/#token=" in shown.output
    result, lines = doctor(doctor_env)
    assert f"127.0.0.1:{doctor_env['HEADROOM_PORT']} is free" in lines["port"][1], result.output


def test_log_file_rotates_at_the_documented_size(tmp_path):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        path = setup_logging("info", str(tmp_path / "logs" / "h.log"))
        handler = root.handlers[0]
        assert (handler.maxBytes, handler.backupCount) == (10 * MiB, 5)
        assert (MAX_BYTES, BACKUP_COUNT) == (10 * MiB, 5)
        line = "x" * 1023
        for _ in range(MAX_BYTES // 1024 + 100):  # a little more than one file's worth
            logging.getLogger("headroom.test").info(line)
        handler.flush()
        assert path.stat().st_size < MAX_BYTES
        assert (tmp_path / "logs" / "h.log.1").stat().st_size <= MAX_BYTES
        assert not (tmp_path / "logs" / "h.log.2").exists()
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_a_logged_request_path_cannot_forge_a_log_line(tmp_path):
    """What a request sends reaches the log (a refused path, a model name): its control
    characters are escaped, so one record stays one line and the file stays text."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        path = setup_logging("info", str(tmp_path / "h.log"))
        forged = "/v1/models/x\n2026-12-04 17:00:00,000 ERROR   headroom.supervisor: FAKE worker crashed\x00\u2028"
        logging.getLogger("headroom.api").info("GET %s -> 404 not_found", forged)
        try:
            raise ValueError("a traceback keeps its lines")
        except ValueError:
            logging.getLogger("headroom.api").exception("unexpected error in GET /x")
        root.handlers[0].flush()
        lines = path.read_text(encoding="utf-8").splitlines()
        assert "\x00" not in path.read_text(encoding="utf-8")
        assert lines[0].endswith("GET /v1/models/x\\n2026-12-04 17:00:00,000 ERROR   headroom.supervisor: FAKE "
                                 "worker crashed\\x00\\u2028 -> 404 not_found")
        assert not any(line.startswith("2026-12-04 17:00:00,000 ERROR") for line in lines)
        assert lines[1].endswith("unexpected error in GET /x") and lines[2] == "Traceback (most recent call last):"
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_a_websocket_text_frame_that_is_not_utf8_is_one_warning_line(start_server):
    """uvicorn closes such a socket with 1007 and logged an ERROR with its traceback (a
    client's fault in the terminal as if the service had failed)."""
    import base64

    from service.cli.logfile import NOT_UTF8_MESSAGE

    server = start_server(fake=True)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        key = base64.b64encode(os.urandom(16)).decode()
        conn.sendall((f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                      f"Authorization: Bearer {server.token}\r\n\r\n").encode())
        assert conn.recv(4096).startswith(b"HTTP/1.1 101")
        payload, mask = b"\xff\xfe{", os.urandom(4)
        conn.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        received = b""
        while b"\x88\x02\x03\xef" not in received:  # a close frame, code 1007
            chunk = conn.recv(4096)
            assert chunk, received
            received += chunk
    wait_for(lambda: NOT_UTF8_MESSAGE in server.log(), 30, "the warning")
    assert "Traceback" not in server.log() and "UnicodeDecodeError" not in server.log()
    assert server.health().status_code == 200


def test_serve_logs_to_the_user_log_dir_with_log_file_auto(start_server, tmp_path):
    log_dir = tmp_path / "user-logs"
    server = start_server(["--log-file", "auto"], {"HEADROOM_LOG_DIR": str(log_dir)}, fake=True)
    log = log_dir / "headroom.log"
    wait_for(lambda: log.exists() and "engine ready" in log.read_text(), 60, "the log file")
    assert f"listening on http://127.0.0.1:{server.port}" in log.read_text()
    assert "listening" not in server.log()  # not on stderr as well


def test_no_runtime_dir_warning_without_xdg_runtime_dir(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "HEADROOM_RUNTIME_DIR")
    }
    env["TMPDIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT)
    code = (
        "from service.supervision.stale import default_pidfile; "
        "from service.common.paths import runtime_dir; print(runtime_dir()); print(default_pidfile())"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    runtime, pidfile = result.stdout.split()
    assert Path(pidfile).parent == Path(runtime)
    if not Path(f"/run/user/{os.getuid()}").is_dir():
        assert Path(runtime).is_relative_to(tmp_path)  # platformdirs' private fallback


def test_doctor_says_when_the_cpu_kernels_have_no_compiler(doctor_env):
    """On a machine without CUDA: the C compiler the CPU kernels build with, or a WARN
    naming the fix when there is none."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the kernels line is about Triton where CUDA works")
    result, lines = doctor(doctor_env)
    assert lines["kernels"][0] == "OK" and "C compiler" in lines["kernels"][1], result.output
    result, lines = doctor({**doctor_env, "CC": "/nonexistent/cc"})
    assert lines["kernels"][0] == "WARN" and "no C compiler at CC=/nonexistent/cc" in lines["kernels"][1]
    assert "fix: install gcc or clang" in result.output


def test_doctor_reads_the_config_file_given_with_config(doctor_env, tmp_path):
    """``--config`` as serve and plan take it, winning over ``HEADROOM_CONFIG`` (an
    empty, good file here)."""
    other = tmp_path / "other.toml"
    other.write_text("port = 70000\n")
    result = CliRunner().invoke(main, ["doctor", "--config", str(other)], env=doctor_env)
    assert result.exit_code == 1, result.output
    config_line = next(line for line in result.output.splitlines() if " config " in line)
    assert config_line.startswith("FAIL") and f"--port ({other})" in config_line
    assert f"fix: correct or remove {other}" in result.output
