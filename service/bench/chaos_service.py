"""The service a chaos run plays against (:mod:`service.bench.chaos`): ``headroom serve``
started in a work folder with the fault hook armed and a simulated desktop (or the real
card), its health, and the second process that takes GPU memory (``--hog``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service.bench.chaos_options import ChaosOptions

# A second process on the GPU (--hog): takes and frees memory in a loop, with torch only.
HOG_SCRIPT = r"""
import sys, time, torch
top = float(sys.argv[1])
steps = [s for s in (0.25, 0.5, 1.0, 0.75, 0.25) if s * top >= 0.05]
torch.empty(1, device="cuda")  # ready only once CUDA answers
print("hog ready", flush=True)
while True:
    for share in steps:
        x = torch.empty(int(share * top * (1 << 30)), dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        time.sleep(3.0)
        del x
        torch.cuda.empty_cache()
        time.sleep(1.5)
"""


def default_timeline(horizon_s: float = 6 * 3600, period_s: float = 24.0) -> dict:
    """A desktop in a loop: a game takes 40% of the card, a video tab 7% more on top,
    then both leave; repeated every ``period_s`` seconds up to ``horizon_s``."""
    steps: list[list] = []
    t = 0.0
    while t < horizon_s:
        share = period_s / 24.0
        steps += [
            [t, 0],
            [t + 6 * share, "40%"],
            [t + 12 * share, "47%"],
            [t + 16 * share, "40%"],
            [t + 20 * share, 0],
        ]
        t += period_s
    return {"steps": steps}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChaosService:
    """``headroom serve`` started by the run, its folders under ``workdir``."""

    def __init__(self, opts: ChaosOptions, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults_dir = workdir / "faults"
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        config = workdir / "config.toml"
        config.touch()
        env = dict(os.environ)
        env.pop("HEADROOM_API_KEY", None)
        env.update(
            HEADROOM_CONFIG=str(config),
            HEADROOM_CONFIG_DIR=str(workdir / "config"),
            HEADROOM_RUNTIME_DIR=str(workdir / "runtime"),
            HEADROOM_FAULTS_DIR=str(self.faults_dir),
            PYTHONUNBUFFERED="1",
        )
        self.token_path = workdir / "config" / "token"
        args = ["--port", str(self.port), "--device", opts.device]
        args += ["--model", opts.model] if opts.model else []
        # Every kill is a restart on purpose: room for them besides a real crash loop.
        args += ["--max-restarts", str(opts.kills + 5)]
        if opts.hog_gib is None:
            timeline = opts.vram_timeline
            if timeline is None:
                timeline = workdir / "timeline.json"
                timeline.write_text(json.dumps(default_timeline()))
            args += ["--vram-source", "simulated", "--device-total", opts.device_total]
            args += ["--vram-timeline", str(timeline), "--replan-hold", "2"]
        args += list(opts.serve_args)
        self.log_path = workdir / "serve.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "service.cli", "serve", *args]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def exited(self) -> str | None:
        """Why the service is gone, when it has exited (its code and its log's last line),
        else None."""
        code = self.proc.poll()
        if code is None:
            return None
        self._log.flush()
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "(empty)"
        return (f"the started headroom serve exited with code {code} before it was ready; its log ends: "
                f"{last} (log: {self.log_path})")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def health(http: httpx.Client) -> dict | None:
    try:
        r = http.get("/api/health", timeout=10)
        body = r.json()
        return body if r.status_code == 200 else dict(body, _not_ready=True)
    except (httpx.HTTPError, ValueError):
        return None


def wait_ready(http: httpx.Client, timeout_s: float, other_than: int | None = None,
               service: ChaosService | None = None) -> dict:
    """The health report once ready (with a worker pid other than ``other_than``).

    Raises:
        RuntimeError: not ready within ``timeout_s``, or ``service`` (the one the run
            started) exited meanwhile: a bad ``--model`` or ``--serve-arg`` is not
            waited for as a slow start (the message gives its exit code and log line).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gone = service.exited() if service is not None else None
        if gone is not None:
            raise RuntimeError(gone)
        h = health(http)
        if h and not h.get("_not_ready") and h.get("worker_pid") not in (None, other_than):
            return h
        time.sleep(0.1)
    raise RuntimeError(f"the service was not ready within {timeout_s:.0f} s")
