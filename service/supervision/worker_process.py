"""One incarnation of the engine worker, seen from the service: spawn, pipe, exit.

The worker is a ``multiprocessing`` child started with the *spawn* method running
:func:`engine.worker.process.worker_main` (that import is by name, in the child: this module
never imports the engine's torch code). Three daemon threads serve it, so the event
loop never blocks on the pipe:

- the reader waits on the pipe *and* the process sentinel together; it delivers
  every message, then the exit, at the moment the process ends (no polling timeout);
- the writer sends queued messages, so a worker busy in a long step (or hung) never
  stalls the event loop on a full pipe;
- the output reader logs the worker's stdout/stderr line by line with a
  ``[worker PID]`` prefix and keeps the last lines for failure reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import msgspec

from engine.wire.ipc import (
    FromWorker,
    Shutdown,
    ToWorker,
    WorkerConfig,
    encode,
    from_worker_decoder,
)

log = logging.getLogger("headroom.supervisor")
worker_log = logging.getLogger("headroom.worker")

# The worker's entry point, imported by name in the child process only.
_WORKER_TARGET = "engine.worker.process"


@dataclass(frozen=True)
class ExitStatus:
    """How a worker process ended.

    ``exit_code`` is the process's exit status (None if unknown); ``signal`` the name
    of the signal that killed it (``"SIGKILL"``), else None; ``last_lines`` the last
    lines it printed, oldest first.
    """

    exit_code: int | None
    signal: str | None
    last_lines: tuple[str, ...]

    def describe(self) -> str:
        """One line for logs and health reports, e.g. ``"was killed by SIGKILL"``."""
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.exit_code}"


def _spawn_target(conn: Connection, config: WorkerConfig, log_conn: Connection | None) -> None:
    """Trampoline run in the child: import the worker module there, not here."""
    import importlib

    importlib.import_module(_WORKER_TARGET).worker_main(conn, config, log_conn)


class WorkerProcess:
    """A spawned engine worker and the threads that talk to it.

    Callbacks run on the event loop thread: ``on_message(msg)`` for each message in
    order, then ``on_exit(status)`` exactly once, after the last message.
    """

    def __init__(
        self,
        config: WorkerConfig,
        *,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[FromWorker], None],
        on_exit: Callable[[ExitStatus], None],
        keep_lines: int = 40,
    ) -> None:
        self._config = config
        self._loop = loop
        self._on_message = on_message
        self._on_exit = on_exit
        self._lines: deque[str] = deque(maxlen=keep_lines)
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._output_thread: threading.Thread | None = None
        self.started_at = 0.0
        self.exited = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Spawn the worker. Call on the event loop's thread: Linux delivers the
        worker's parent-death signal when the *thread* that spawned it ends, and the
        loop thread lives as long as the service."""
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        log_r: Connection | None = None
        log_w: Connection | None = None
        if os.name == "posix":
            # A one-way pipe is a plain os.pipe() here; the child dup2()s its write end
            # onto fds 1 and 2.
            log_r, log_w = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_spawn_target,
            args=(child_conn, self._config, log_w),
            name="headroom-worker",
            daemon=True,
        )
        process.start()
        self.started_at = time.monotonic()
        # Drop our copies of the child's ends, so EOF reaches us when it dies.
        child_conn.close()
        if log_w is not None:
            log_w.close()
        self._process = process
        self._conn = parent_conn
        prefix = f"[worker {process.pid}]"
        if log_r is not None:
            self._output_thread = threading.Thread(
                target=self._read_output, args=(log_r, prefix), name="worker-output", daemon=True
            )
            self._output_thread.start()
        threading.Thread(target=self._read, name="worker-reader", daemon=True).start()
        threading.Thread(target=self._write, name="worker-writer", daemon=True).start()
        log.info("worker started, pid %d", process.pid)

    def send(self, message: ToWorker) -> None:
        """Queue a message for the worker; never blocks. Dropped if the worker is gone."""
        if not self.exited:
            self._outbox.put(encode(message))

    def kill(self) -> None:
        """SIGKILL the worker (a hung one ignores anything gentler)."""
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self._process.kill()

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Ask the worker to exit, wait up to ``timeout_s`` seconds, then kill it."""
        if self._process is None or self.exited:
            return
        self.send(Shutdown())
        deadline = time.monotonic() + timeout_s
        while self._process.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.kill()
        await asyncio.to_thread(self._process.join, 2.0)

    def last_lines(self) -> tuple[str, ...]:
        return tuple(self._lines)

    # -- threads -------------------------------------------------------------------

    def _post(self, callback: Callable, *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            self._loop.call_soon_threadsafe(callback, *args)

    def _read(self) -> None:
        assert self._process is not None and self._conn is not None
        conn, sentinel = self._conn, self._process.sentinel
        conn_open = True
        while True:
            ready = wait([conn, sentinel] if conn_open else [sentinel])
            if conn_open and conn in ready:
                # Messages first: everything the worker sent before dying is delivered.
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    conn_open = False
                    continue
                try:
                    message = from_worker_decoder.decode(data)
                except msgspec.DecodeError:
                    log.error("undecodable message from the worker (%d bytes)", len(data))
                    continue
                self._post(self._on_message, message)
                continue
            if sentinel in ready:
                break
        self._process.join()
        self.exited = True
        self._outbox.put(None)
        if self._output_thread is not None:
            # Let the last lines (a traceback) land before the exit is reported.
            self._output_thread.join(timeout=0.5)
        code = self._process.exitcode
        sig = None
        if code is not None and code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
        with contextlib.suppress(OSError):
            conn.close()
        self._post(
            self._on_exit, ExitStatus(exit_code=code, signal=sig, last_lines=self.last_lines())
        )

    def _write(self) -> None:
        assert self._conn is not None
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                return  # the worker is gone; the reader reports it

    def _read_output(self, log_r: Connection, prefix: str) -> None:
        fd = log_r.fileno()
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._emit_line(prefix, raw)
        if pending:
            self._emit_line(prefix, pending)
        log_r.close()

    def _emit_line(self, prefix: str, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if not line.strip():
            return
        self._lines.append(line)
        worker_log.info("%s %s", prefix, line)
