"""Benchmark of the event fan-out: delivery latency to many subscribers, and what one
stalled client costs the event loop.

    python -m service.bench.events                 # in-process, then real sockets
    python -m service.bench.events --no-sockets    # the hub alone

1. **In-process**: ``--subscribers`` tasks each read their own subscription while
   events are published at ``--rate`` per second; latency is from ``publish()`` to the
   subscriber's ``get()`` returning. Then the same with one extra subscriber that never
   reads: it is dropped (close code 4008) when its queue overflows, and the event loop's
   lag (how late a 5 ms sleep wakes) is measured throughout.
2. **Sockets**: a real server (uvicorn, in a child process, the events router on the
   hub) and ``--subscribers`` WebSocket clients (the ``websockets`` package, in this
   process); latency is the client's receive time minus the event's ``ts``. Then again
   with one stalled client: a raw TCP connection that completes the handshake and never
   reads again (receive buffer 4 KiB). The server's sockets get ``--sndbuf`` (64 KiB)
   so the stalled client's buffers fill within seconds (with the kernel's autotuning,
   up to 4 MiB, it takes a minute of events; uvicorn's keepalive, a ping every 20 s
   with a 20 s timeout, closes such a client after about 40 s anyway). The server
   reports its event loop's lag and whether (and after how many events) the stalled
   client was dropped.

Figures are printed as a table and, with ``--json``, as one JSON object. The clients share
one Python process, so the socket latency includes their own queueing."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any

import msgspec

from engine.common.units import GiB, MiB
from service.events.hub import EventHub
from service.events.schemas import CLOSE_TOO_SLOW, Consumer, VramEvent
from service.events.subscription import SubscriptionClosed

TOKEN = "bench-token-0123456789abcdef"


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(pct(values, 50) * 1e3, 3),
        "p99_ms": round(pct(values, 99) * 1e3, 3),
        "max_ms": round(max(values) * 1e3, 3) if values else float("nan"),
        "mean_ms": round(statistics.fmean(values) * 1e3, 3) if values else float("nan"),
    }


def sample_event(i: int) -> VramEvent:
    """A VRAM sample of realistic size (~700 bytes of JSON, five top consumers)."""
    free = 8 * GiB - (i % 1000) * MiB
    return VramEvent(
        device="NVIDIA GeForce RTX 4090 (GPU 0)",
        source="nvml",
        total_bytes=24 * GiB,
        free_bytes=free,
        ours_bytes=12 * GiB,
        others_bytes=24 * GiB - free - 12 * GiB,
        reserve_bytes=1 * GiB,
        headroom_bytes=free - GiB,
        top_consumers=[Consumer(1000 + k, f"process-{k}", (k + 1) << 28) for k in range(5)],
    )


class LagMonitor:
    """How late ``asyncio.sleep(period)`` wakes, sampled continuously."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self.times: list[float] = []  # loop time each sample started
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, loop.time() - t - self.period_s))
            self.times.append(t)

    async def stop(self) -> list[float]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.lags


# -- 1. in-process -------------------------------------------------------------------------------


async def bench_inprocess(
    subscribers: int, events: int, rate: float, stalled: bool
) -> dict[str, Any]:
    hub = EventHub()
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    publish_cost: list[float] = []
    subs = [hub.subscribe() for _ in range(subscribers)]
    stuck = hub.subscribe() if stalled else None
    done = asyncio.Event()

    async def reader(sub) -> None:
        try:
            while True:
                item = await sub.get()
                latencies.append(time.perf_counter() - sent_at[item.event.seq])
        except SubscriptionClosed:
            pass

    readers = [asyncio.ensure_future(reader(s)) for s in subs]
    lag = LagMonitor()
    lag.start()
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    for i in range(events):
        target = start + i / rate
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()
        sent_at[hub.seq + 1] = t0
        hub.publish(sample_event(i), coalesce=False)
        publish_cost.append(time.perf_counter() - t0)
    await asyncio.sleep(0.1)
    done.set()
    for s in subs:
        s.close()
    await asyncio.gather(*readers)
    lags = await lag.stop()
    out: dict[str, Any] = {
        "subscribers": subscribers,
        "events": events,
        "rate_per_s": rate,
        "delivered": len(latencies),
        "latency": summary_ms(latencies),
        "publish_call": summary_ms(publish_cost),
        "loop_lag": summary_ms(lags),
    }
    if stuck is not None:
        out["stalled_dropped"] = stuck.close_code == CLOSE_TOO_SLOW
        out["stalled_close_code"] = stuck.close_code
    hub.close()
    return out


# -- 2. sockets ----------------------------------------------------------------------------------


def _server_main(port: int, conn: Any, sndbuf: int) -> None:
    """The child process: uvicorn serving the events router; publishes on command.

    ``sndbuf`` (bytes, 0: the kernel's autotuning) is set on the listening socket, so
    accepted sockets inherit it: a stalled client then fills its buffers in seconds.
    """
    import uvicorn
    from litestar import Litestar

    from service.control.routes import events_router

    class NoControl:
        def restart(self) -> None: ...
        def set_reserve(self, reserve: Any) -> None: ...
        def set_kv_cache(self, size: Any) -> None: ...
        def clear_prefix_cache(self) -> None: ...

    hub = EventHub()

    async def commands() -> None:
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "count":
                conn.send(hub.subscriber_count)
            elif cmd[0] == "publish":
                _, n, rate = cmd
                lag = LagMonitor()
                lag.start()
                dropped_before = hub.dropped
                dropped_at: int | None = None
                dropped_time = 0.0
                start = time.perf_counter()
                for i in range(n):
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    hub.publish(sample_event(i), coalesce=False)
                    if dropped_at is None and hub.dropped > dropped_before:
                        dropped_at = i + 1
                        dropped_time = asyncio.get_running_loop().time()
                await asyncio.sleep(0.5)
                lags = await lag.stop()
                split = {}
                if dropped_at is not None:
                    before = [
                        x for x, t in zip(lag.lags, lag.times, strict=True) if t < dropped_time
                    ]
                    after = [
                        x for x, t in zip(lag.lags, lag.times, strict=True) if t >= dropped_time
                    ]
                    split = {
                        "loop_lag_before_drop": summary_ms(before),
                        "loop_lag_after_drop": summary_ms(after),
                    }
                conn.send(
                    {
                        "loop_lag": summary_ms(lags),
                        "dropped": hub.dropped - dropped_before,
                        "dropped_after_events": dropped_at,
                        "subscribers_after": hub.subscriber_count,
                        **split,
                    }
                )
            elif cmd[0] == "stop":
                hub.close()
                server.should_exit = True
                return

    async def startup() -> None:
        hub.attach_loop()
        asyncio.ensure_future(commands())

    app = Litestar(
        route_handlers=[events_router(hub, NoControl(), token=TOKEN)],
        on_startup=[startup],
        openapi_config=None,
        logging_config=None,
    )
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="error", ws="websockets-sansio", lifespan="on"
    )
    server = uvicorn.Server(config)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    listener.bind(("127.0.0.1", port))
    conn.send("up")
    server.run(sockets=[listener])


class _Stamp(msgspec.Struct):
    ts: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stalled_client(port: int) -> socket.socket:
    """Complete a WebSocket handshake, then never read again (4 KiB receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        (
            f"GET /api/events?token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"handshake failed: {head!r}")
    return s


async def bench_sockets(
    subscribers: int, events: int, rate: float, stalled: bool, sndbuf: int = 0
) -> dict[str, Any]:
    import websockets

    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server_main, args=(port, child, sndbuf), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, parent.recv) == "up"
    url = f"ws://127.0.0.1:{port}/api/events?token={TOKEN}"
    for _ in range(100):
        try:
            async with websockets.connect(url):
                break
        except OSError:
            await asyncio.sleep(0.05)
    latencies: list[float] = []
    clients = [await websockets.connect(url, max_queue=None) for _ in range(subscribers)]
    stuck = _stalled_client(port) if stalled else None

    stamp = msgspec.json.Decoder(_Stamp)

    async def read(ws) -> None:
        await ws.recv()  # the snapshot
        async for frame in ws:
            now = time.time()
            latencies.append(now - stamp.decode(frame).ts)

    readers = [asyncio.ensure_future(read(ws)) for ws in clients]

    async def ask(*cmd: Any) -> Any:
        parent.send(cmd)
        return await loop.run_in_executor(None, parent.recv)

    while await ask("count") < subscribers + (1 if stalled else 0):
        await asyncio.sleep(0.05)
    server = await ask("publish", events, rate)
    await asyncio.sleep(0.2)
    for ws in clients:
        await ws.close()
    await asyncio.gather(*readers, return_exceptions=True)
    stuck_closed = None
    if stuck is not None:
        stuck.setblocking(False)
        try:
            stuck_closed = stuck.recv(1 << 20) == b""
        except BlockingIOError:
            stuck_closed = False
        stuck.close()
    parent.send(("stop",))
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    out = {
        "subscribers": subscribers,
        "stalled_client": stalled,
        "events": events,
        "rate_per_s": rate,
        "server_sndbuf": sndbuf,
        "delivered": len(latencies),
        "expected": subscribers * events,
        "latency": summary_ms(latencies),
        "server": server,
    }
    if stuck_closed is not None:
        out["server"]["stalled_socket_readable_eof"] = stuck_closed
    return out


# -- main -----------------------------------------------------------------------------------------


def _line(name: str, r: dict[str, Any]) -> str:
    lat = r["latency"]
    text = (
        f"{name:<34} delivered {r['delivered']:>7}  latency p50 {lat['p50_ms']:>7.3f} ms  "
        f"p99 {lat['p99_ms']:>7.3f} ms  max {lat['max_ms']:>8.3f} ms"
    )
    lag = r.get("loop_lag") or r.get("server", {}).get("loop_lag")
    if lag:
        text += f"  | loop lag p99 {lag['p99_ms']:.3f} ms max {lag['max_ms']:.3f} ms"
    return text


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    results["inprocess"] = await bench_inprocess(args.subscribers, args.events, args.rate, False)
    results["inprocess_stalled"] = await bench_inprocess(
        args.subscribers, args.events, args.rate, True
    )
    if args.sockets:
        results["sockets"] = await bench_sockets(
            args.subscribers, args.socket_events, args.socket_rate, False, args.sndbuf
        )
        results["sockets_stalled"] = await bench_sockets(
            args.subscribers, args.socket_events, args.socket_rate, True, args.sndbuf
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.bench.events", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--events", type=int, default=5000, help="in-process events")
    parser.add_argument("--rate", type=float, default=1000.0, help="in-process events per second")
    parser.add_argument("--socket-events", type=int, default=2000)
    parser.add_argument("--socket-rate", type=float, default=100.0)
    parser.add_argument(
        "--sndbuf",
        type=int,
        default=64 * 1024,
        help="SO_SNDBUF of the server's sockets in bytes (0: kernel autotuning, up to 4 MiB "
        "on Linux, so a stalled client takes about a minute of events to fill)",
    )
    parser.add_argument("--no-sockets", dest="sockets", action="store_false")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for name, r in results.items():
        print(_line(name, r))
        if name == "inprocess":
            pc = r["publish_call"]
            print(
                f"{'':<34} publish() to {r['subscribers']} subscribers: p50 {pc['p50_ms']:.3f} ms, p99 {pc['p99_ms']:.3f} ms"
            )
        if "stalled_dropped" in r:
            print(
                f"{'':<34} stalled subscriber dropped: {r['stalled_dropped']} (close code {r['stalled_close_code']})"
            )
        if name == "sockets_stalled":
            s = r["server"]
            print(
                f"{'':<34} subscribers dropped: {s['dropped']} (first after "
                f"{s['dropped_after_events']} events); left {s['subscribers_after']} of "
                f"{r['subscribers'] + 1}; deliveries {r['delivered']} of {r['expected']}"
            )
            if "loop_lag_before_drop" in s:
                b, a = s["loop_lag_before_drop"], s["loop_lag_after_drop"]
                print(
                    f"{'':<34} loop lag p99 while it stalled {b['p99_ms']:.3f} ms, "
                    f"after its drop {a['p99_ms']:.3f} ms"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
