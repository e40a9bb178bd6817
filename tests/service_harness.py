"""Real ``headroom serve`` processes on loopback, for the service tests.

:class:`ServerProcess` starts the console script on a free port with its own empty
config file, waits for ``/api/health``, and on the way out stops it and, if a test
failed, shows its log. Fixtures (registered in conftest.py):

- ``real_server`` (session): the default model, shared by tests that do not break it.
  It depends on conftest's ``default_model_dir``, which converts the model once into
  a session cache that every server started here inherits through the environment.
- ``keyed_server`` (session, in keyed_server.py): the default model behind ``--api-key``.
- ``start_server`` (function): a factory for servers a test may kill or misconfigure,
  with the real engine or the fake one of ``fake_engine.py``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.common.units import GiB, MiB
from engine.memory.plan import LedgerEntry, MemoryPlan
from engine.wire.messages import EngineInfo, EngineStats

TESTS_DIR = Path(__file__).parent
READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headroom_command() -> list[str]:
    script = Path(sys.executable).parent / "headroom"
    if script.exists():
        return [str(script)]
    found = shutil.which("headroom")
    return [found] if found else [sys.executable, "-m", "service.cli"]


def engine_info(**overrides: Any) -> EngineInfo:
    """An engine's facts for tests that need one but no engine: a 2048-token context,
    101 pages of 1 MiB, on the CPU; ``overrides`` replace fields."""
    fields: dict[str, Any] = dict(
        model_name="m",
        model_dir="/m",
        architecture="A",
        vocab_size=10,
        max_context_tokens=2048,
        model_context_tokens=2048,
        eos_token_ids=[0],
        device="cpu",
        dtype="float32",
        page_size=16,
        num_pages=101,
        kv_cache_bytes=101 * MiB,
        weight_bytes=0,
        max_prefill_tokens=2048,
        max_running_requests=8,
    )
    fields.update(overrides)
    return EngineInfo(**fields)


def engine_stats(**counts: int) -> EngineStats:
    """An engine's counters for tests that need them but no engine: each 0 unless
    ``counts`` gives it."""
    names = ("running", "waiting", "free_pages", "total_pages", "cached_pages", "prefix_hit_tokens",
             "prefix_lookup_tokens", "finished", "aborted", "failed")
    return EngineStats(**{**dict.fromkeys(names, 0), **counts})

def memory_plan(**overrides: Any) -> MemoryPlan:
    """A memory plan for tests that need one but no engine: a simulated 16 GiB card,
    1,000 pages of 16 tokens in a 10 GiB pool, an 8,192-token context, 64 running
    requests; ``overrides`` replace fields."""
    fields: dict[str, Any] = dict(
        device="sim",
        simulated=True,
        ledger=[LedgerEntry("device total", 16 * GiB, "+", "simulated")],
        budget_bytes=12 * GiB,
        fixed_bytes=2 * GiB,
        kv_pool_bytes=10 * GiB,
        num_pages=1000,
        page_size=16,
        max_context_tokens=8192,
        min_context_tokens=8192,
        fits=True,
        shortfall_bytes=0,
        suggestions=[],
        max_prefill_tokens=2048,
        max_running_requests=64,
    )
    fields.update(overrides)
    return MemoryPlan(**fields)

def simulated_vram_args(timeline: Path) -> list[str]:
    """``headroom serve`` flags for a 4 GiB card whose other users follow ``timeline``
    (a JSON file of ``{"steps": [[seconds, size], ...]}``), 2048-token context, 8
    running requests."""
    return [
        "--device-total",
        "4GiB",
        "--max-model-len",
        "2048",
        "--max-running-requests",
        "8",
        "--vram-source",
        "simulated",
        "--vram-timeline",
        str(timeline),
    ]


def fake_systemctl(folder: Path, returncode: int, stderr: str = "") -> str:
    """A PATH whose first folder (``folder``, created) holds a ``systemctl`` that prints
    ``stderr`` and exits with ``returncode`` for any command: 1 with "Failed to connect
    to bus" is a machine without a systemd user instance, 0 one with it."""
    folder.mkdir(exist_ok=True)
    script = folder / "systemctl"
    script.write_text(f"#!/bin/sh\necho {shlex.quote(stderr)} >&2\nexit {returncode}\n")
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``predicate`` every ``interval_s`` seconds until it returns something true
    (returned); fails the test naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


class ServerProcess:
    """One ``headroom serve`` child process.

    Its local token lives in ``tmp/config-dir`` (``HEADROOM_CONFIG_DIR``) and its worker
    pid file in ``tmp/runtime`` (``HEADROOM_RUNTIME_DIR``), so no test touches the
    user's (or another test's) token or stale-worker list.

    Args:
        tmp: a folder for its config file, token, pid file and log.
        args: extra command-line arguments.
        env: extra environment variables.
        fake: use tests/fake_engine.py instead of the real engine.
        new_session: start it in its own session and process group (``pgid`` = its
            pid), so a test can signal the group as a terminal's Ctrl-C does.
    """

    def __init__(
        self,
        tmp: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        *,
        fake: bool = False,
        fake_model_dir: str | None = None,
        new_session: bool = False,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        config = tmp / "config.toml"
        config.touch()
        full_env = dict(os.environ)
        full_env.pop("HEADROOM_API_KEY", None)
        full_env["HEADROOM_CONFIG"] = str(config)
        full_env["HEADROOM_CONFIG_DIR"] = str(tmp / "config-dir")
        full_env["HEADROOM_RUNTIME_DIR"] = str(tmp / "runtime")
        full_env["PYTHONUNBUFFERED"] = "1"
        if fake:
            full_env["PYTHONPATH"] = os.pathsep.join(
                [str(TESTS_DIR), full_env.get("PYTHONPATH", "")]
            )
            full_env["HEADROOM_ENGINE_FACTORY"] = "fake_engine:FakeEngine"
            if fake_model_dir:
                full_env["HEADROOM_FAKE_MODEL_DIR"] = fake_model_dir
        full_env.update(env or {})
        self.env = full_env
        self.command = [*headroom_command(), "serve", "--port", str(self.port), *(args or [])]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=new_session,
        )

    @property
    def token(self) -> str:
        """The local token the server created (read once it has started)."""
        path = Path(self.env["HEADROOM_CONFIG_DIR"]) / "token"
        deadline = time.monotonic() + 30
        while not path.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"no token file at {path}:\n{self.log()}")
            time.sleep(0.05)
        return path.read_text().strip()

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/api/events"

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response:
        return httpx.get(self.base_url + "/api/health", timeout=5.0)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if self.health().status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def worker_pid(self) -> int:
        pid = self.health().json()["worker_pid"]
        assert isinstance(pid, int), self.health().text
        return pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def serving(server: ServerProcess) -> Iterator[ServerProcess]:
    """For a fixture, ``yield from serving(ServerProcess(...))``: waits until ``server``
    is ready, yields it, then stops it and prints its log (pytest shows it when a test
    failed)."""
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        print(f"--- log of {' '.join(server.command)} ---\n{server.log()}")


@pytest.fixture(scope="session")
def real_server(tmp_path_factory, default_model_dir) -> Iterator[ServerProcess]:
    """The default model, 256 KV pages (about 4k tokens) so a prompt larger than the pool is cheap to reach."""
    yield from serving(ServerProcess(tmp_path_factory.mktemp("real"), ["--num-pages", "256"]))


@pytest.fixture
def start_server(tmp_path, default_model_dir) -> Iterator:
    """Factory: ``start_server(args, env, fake=False, wait=True, new_session=False) ->
    ServerProcess``; every server it starts is stopped after the test (its log shown on
    failure)."""
    servers: list[ServerProcess] = []

    def start(args=None, env=None, *, fake=False, wait=True, new_session=False) -> ServerProcess:
        server = ServerProcess(
            tmp_path,
            args,
            env,
            fake=fake,
            fake_model_dir=default_model_dir if fake else None,
            new_session=new_session,
        )
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
        # Captured: pytest shows it only when the test failed.
        print(f"--- log of {' '.join(server.command)} ---\n{server.log()}")


def served_greedy_tokens(server: ServerProcess, prompt, steps: int) -> list[str]:
    """The ``steps`` greedy tokens ``server`` completes ``prompt`` (ids or text) with,
    each as the tokenizer decodes it alone (``/v1/completions``' logprobs tokens)."""
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": steps, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@contextlib.contextmanager
def tiny_model_server(tmp_path_factory, make_tiny_hf_model, tokenizer, kind: str, **config) -> Iterator[tuple]:
    """A tiny random transformers model of ``kind`` (``make_tiny_hf_model``'s, its config
    with ``config``) saved with ``tokenizer`` and served by ``headroom serve`` on the CPU:
    ``(the transformers model, the server)`` while the context lasts."""
    folder = tmp_path_factory.mktemp(f"tiny-{kind}")
    hf = make_tiny_hf_model(kind, folder, vocab_size=len(tokenizer), **config)
    tokenizer.save_pretrained(folder)
    server = ServerProcess(tmp_path_factory.mktemp(f"{kind}-serve"), ["--model", str(folder), "--device", "cpu"])
    try:
        server.wait_ready()
        yield hf, server
    finally:
        server.stop()
