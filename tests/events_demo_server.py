"""A stand-alone control plane for the dashboard: the real router and hub, a simulated
VRAM timeline, and a stand-in "worker" that is a real child process.

Not the service: nothing here loads a model. It serves ``/api/events``, ``/api/status``,
the control routes and ``/ui`` exactly as the service does, so
the dashboard and ``ui-bridge``'s browser test can run without a model. The worker is a
sleeping child process: kill it (``kill -9 <worker_pid from /api/status>``) and the
demo reports ``worker exited`` (with the signal), ``restarting``, then ``started`` and
``ready`` again, as the supervisor will. ``POST /api/control/restart`` does the same,
not counted in ``restarts`` (no crash), as the supervisor does not count it.

    python tests/events_demo_server.py --port 8765      # prints URL and token as JSON

The first stdout line is ``{"url": ..., "token": ..., "ui": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvicorn  # noqa: E402
from litestar import Litestar  # noqa: E402
from service_harness import engine_info, engine_stats, memory_plan  # noqa: E402

from engine.common.units import GiB, MiB  # noqa: E402
from engine.memory.plan import LedgerEntry, MemoryPlan  # noqa: E402
from service.common.token import new_token  # noqa: E402
from service.control.routes import events_router  # noqa: E402
from service.events import schemas as ev  # noqa: E402
from service.events.hub import EventHub  # noqa: E402
from service.http.dashboard import dashboard_router  # noqa: E402
from service.http.security import SecurityMiddleware  # noqa: E402

TOTAL = 16 * GiB
OURS = 9 * GiB


# The demo engine's facts: Qwen3-1.7B's shape, in bfloat16.
DEMO_MODEL = {
    "model_name": "demo-model",
    "model_dir": "/nowhere/demo-model",
    "architecture": "Qwen3ForCausalLM",
    "vocab_size": 151936,
    "max_context_tokens": 32768,
    "model_context_tokens": 40960,
    "eos_token_ids": [151645],
    "device": "simulated",
    "dtype": "bfloat16",
    "weight_bytes": 2 * GiB + 300 * MiB,
    "max_running_requests": 64,
}


def demo_plan(kv_bytes: int) -> MemoryPlan:
    entries = [
        ("device total", TOTAL, "+", "simulated"),
        ("used by other processes", 2 * GiB, "-", "simulated, now"),
        ("desktop reserve", 1331 * MiB, "-", "auto: display attached"),
        ("safety margin", 291 * MiB, "-", "auto"),
        ("budget", 12 * GiB + 426 * MiB, "=", ""),
        ("weights", 2 * GiB + 300 * MiB, "-", "exact, from tensor shapes"),
        ("CUDA context and runtime", 420 * MiB, "-", "measured"),
        ("workspace: attention", 256 * MiB, "-", "declared"),
        ("sampler and logits", 310 * MiB, "-", "measured, 64 requests x vocab 151936"),
        ("prefill activation peak", 900 * MiB, "-", "measured at 2048 tokens"),
        ("CUDA graph pool", 180 * MiB, "-", "measured at capture"),
        ("KV cache pool", kv_bytes, "=", f"{kv_bytes // (2 * MiB)} pages of 2 MiB"),
    ]
    return memory_plan(
        device="simulated device (16.00 GiB)",
        ledger=[LedgerEntry(*e) for e in entries],
        budget_bytes=12 * GiB + 426 * MiB,
        fixed_bytes=4 * GiB + 318 * MiB,
        kv_pool_bytes=kv_bytes,
        num_pages=kv_bytes // (2 * MiB),
        max_context_tokens=32768,
        min_context_tokens=4096,
    )


class DemoWorker:
    """A child process standing in for the engine worker, and the ControlTarget."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.state = "starting"
        self.reserve = 1331 * MiB
        self.kv_bytes = 8 * GiB
        self.finished = 0
        self._task: asyncio.Task | None = None
        self._asked = False  # the next exit was asked for (control restart)

    def health(self, status: str, **kw) -> None:
        self.state = status
        pid = self.proc.pid if self.proc and self.proc.poll() is None else None
        self.hub.publish(
            ev.HealthEvent(
                status=status, model="demo-model", worker_pid=pid, restarts=self.restarts, **kw
            )  # type: ignore[arg-type]
        )

    async def spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(3600)"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.hub.publish(ev.WorkerEvent(phase="started", pid=self.proc.pid, restarts=self.restarts))
        self.health("starting" if self.state == "starting" else "restarting", retry_after_s=1)
        await asyncio.sleep(0.8)  # "loading"
        self.hub.publish(
            ev.EngineInfoEvent(
                info=engine_info(
                    **DEMO_MODEL,
                    num_pages=self.kv_bytes // (2 * MiB),
                    kv_cache_bytes=self.kv_bytes,
                )
            )
        )
        self.hub.publish(ev.PlanEvent(plan=demo_plan(self.kv_bytes)))
        self.health("ready")
        self._task = asyncio.create_task(self._watch(self.proc))

    async def _watch(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            await asyncio.sleep(0.05)
        if proc is not self.proc or self.state == "stopped":
            return
        code = proc.returncode
        sig = -code if code < 0 else None
        self.hub.publish(
            ev.WorkerEvent(
                phase="exited",
                pid=proc.pid,
                exit_code=None if sig else code,
                signal=signal.Signals(sig).name if sig else None,
                reason=f"was killed by {signal.Signals(sig).name}"
                if sig
                else f"exited with code {code}",
                restarts=self.restarts,
                last_lines=["(demo worker: no output)"],
            )
        )
        asked, self._asked = self._asked, False
        self.restarts += 0 if asked else 1
        self.hub.publish(ev.WorkerEvent(phase="restarting", delay_s=0.5, restarts=self.restarts))
        self.health("restarting", retry_after_s=2)
        await asyncio.sleep(0.5)
        await self.spawn()

    # ControlTarget
    def restart(self) -> str:
        if self.proc and self.proc.poll() is None:
            self._asked = True
            self.proc.kill()
        return "the worker is restarting"

    def set_reserve(self, reserve: int | str) -> str:
        self.reserve = 1331 * MiB if reserve == "auto" else int(reserve)
        return f"reserve is now {self.reserve // MiB} MiB"

    def set_kv_cache(self, size: int | None) -> str:
        before = ev.PlanPoint(
            kv_pool_bytes=self.kv_bytes,
            num_pages=self.kv_bytes // (2 * MiB),
            max_prefill_tokens=2048,
        )
        self.kv_bytes = 8 * GiB if size is None else size
        after = ev.PlanPoint(
            kv_pool_bytes=self.kv_bytes,
            num_pages=self.kv_bytes // (2 * MiB),
            max_prefill_tokens=2048,
        )
        self.hub.publish(
            ev.ReplanEvent(
                action="set_kv_cache",
                reason="asked for",
                before=before,
                after=after,
                duration_s=0.12,
            )
        )
        return "KV pool resized"

    def clear_prefix_cache(self) -> str:
        return "prefix cache cleared"

    def stop(self) -> None:
        self.state = "stopped"
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def vram_timeline(hub: EventHub, worker: DemoWorker) -> None:
    """A desktop: a browser that breathes, and a game that comes and goes every 40 s."""
    start = time.monotonic()
    n = 0
    while True:
        t = time.monotonic() - start
        game = 5 * GiB if (t % 40) > 20 else 0
        browser = int(1.2 * GiB + 0.5 * GiB * math.sin(t / 3))
        ours = OURS if worker.state == "ready" else 0
        others = browser + game + 400 * MiB
        free = max(0, TOTAL - ours - others)
        top = [("firefox", browser)] + ([("game", game)] if game else [])
        hub.publish(
            ev.VramEvent(
                device="simulated device (16.00 GiB)",
                source="simulated",
                total_bytes=TOTAL,
                free_bytes=free,
                ours_bytes=ours,
                others_bytes=others,
                reserve_bytes=worker.reserve,
                headroom_bytes=free - worker.reserve,
                top_consumers=[
                    {"pid": 1000 + i, "name": name, "bytes": b}  # type: ignore[misc]
                    for i, (name, b) in enumerate(top)
                ],
            )
        )
        n += 1
        if n % 10 == 0:
            worker.finished += 3
            hub.publish(
                ev.CountersEvent(
                    engine=engine_stats(
                        running=2, free_pages=3000, total_pages=4096, cached_pages=512,
                        prefix_hit_tokens=1000, prefix_lookup_tokens=4000, finished=worker.finished,
                    ),
                    in_flight=2,
                    oom_steps=n // 100,
                    oom_failed_requests=n // 300,
                )
            )
        if n % 100 == 50:
            hub.publish(
                ev.RequestErrorEvent(
                    request_id=f"chatcmpl-demo{n}-0",
                    code="out_of_memory",
                    phase="prefill",
                    action="retry_smaller_chunk",
                    bytes_asked=512 * MiB,
                    headroom_bytes=free - worker.reserve,
                    message="CUDA out of memory (simulated); retried with a 1024-token chunk",
                )
            )
        await asyncio.sleep(0.1)  # 10 Hz, coalesced to 4/s by the hub


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--token", default=None, help="default: a fresh random one")
    args = parser.parse_args()
    token = args.token or new_token()
    port = args.port
    if port == 0:
        with socket.socket() as s:
            s.bind((args.host, 0))
            port = s.getsockname()[1]

    hub = EventHub()
    worker = DemoWorker(hub)
    tasks: list[asyncio.Task] = []

    async def start() -> None:
        hub.attach_loop()
        hub.publish(ev.HealthEvent(status="starting"))
        tasks.append(asyncio.create_task(worker.spawn()))
        tasks.append(asyncio.create_task(vram_timeline(hub, worker)))

    async def stop() -> None:
        for t in tasks:
            t.cancel()
        worker.stop()
        hub.close()

    app = Litestar(
        route_handlers=[events_router(hub, worker, token=token), dashboard_router()],
        on_startup=[start],
        on_shutdown=[stop],
        openapi_config=None,
        logging_config=None,
    )
    url = f"http://{args.host}:{port}"
    print(
        json.dumps(
            {"url": url, "token": token, "ui": f"{url}/ui/#token={token}", "pid": os.getpid()}
        ),
        flush=True,
    )
    # The page's own origin on a loopback Host passes the middleware (service.http.security's
    # same_origin), as in the service.
    secured = SecurityMiddleware(app)
    uvicorn.run(secured, host=args.host, port=port, log_level="warning", ws="websockets-sansio")


if __name__ == "__main__":
    main()
