"""The engine worker process: loads the engine, then serves the service over a pipe.

Started by the service's supervisor with multiprocessing's *spawn* start method (a
fresh interpreter: no CUDA state, no event loop, no Litestar inherited from the
service). :func:`worker_main` is the process target. The loop is single-threaded, as
the engine requires: drain the pipe, run one engine step, send its outputs, beat.

The worker dies with its parent three ways, so no orphan keeps holding the GPU:
Linux's parent-death signal (SIGKILL, set with ``prctl``), the pipe closing (EOF on
the next read), and a re-parenting check (the parent pid changed).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from engine.errors import PlanDoesNotFit, RequestRejected
from engine.ipc import (
    EngineEvents,
    Heartbeat,
    Outputs,
    Ready,
    Rejected,
    Shutdown,
    StatsRequest,
    WorkerConfig,
    WorkerError,
    encode,
    to_worker_decoder,
)
from engine.loader.errors import ModelLoadError
from engine.messages import AbortRequest, GenerateRequest

log = logging.getLogger("headroom.worker")

_PR_SET_PDEATHSIG = 1
# Exit codes the supervisor reads.
EXIT_OK = 0
EXIT_LOAD_FAILED = 3
EXIT_PARENT_GONE = 4


def worker_main(conn: Connection, config: WorkerConfig, log_conn: Connection | None) -> None:
    """Process target: run the worker until the service says stop or goes away.

    Args:
        conn: this end of the duplex pipe; frames are msgpack (:mod:`engine.ipc`).
        config: the frozen start config.
        log_conn: write end of a one-way pipe whose fd becomes this process's stdout
            and stderr, so the service can prefix and log everything printed here
            (tracebacks of a crash included). ``None`` leaves them as inherited.

    Exits with 0 on :class:`engine.ipc.Shutdown` or when the pipe closes, 3 when the
    engine fails to load (a missing model, a memory plan that does not fit...), 4 when
    the parent is gone; an error in a step propagates (exit code 1) after a
    :class:`engine.ipc.WorkerError` is sent.
    """
    if log_conn is not None:
        _redirect_output(log_conn)
    # Ctrl-C in a terminal reaches the whole process group; the service decides when
    # the worker stops (Shutdown, the pipe closing), so a SIGINT here is ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != config.parent_pid:
        # The parent died between spawning us and the prctl call above.
        sys.exit(EXIT_PARENT_GONE)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    started = time.monotonic()
    try:
        engine = _make_engine(config)
    except Exception as exc:  # every load failure is reported, then we exit
        if isinstance(exc, (PlanDoesNotFit, ModelLoadError)):
            # Expected, and their messages say what to do (the service shows them in
            # full): one line, no traceback.
            log.error("the engine cannot start: %s", str(exc).partition("\n")[0])
        else:
            traceback.print_exc()
        _send_quietly(
            conn, WorkerError(message=str(exc), kind=type(exc).__name__, during_load=True)
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LOAD_FAILED)
    load_s = time.monotonic() - started
    conn.send_bytes(encode(Ready(info=engine.info, pid=os.getpid(), load_s=load_s)))
    log.info("engine ready in %.1f s: %s", load_s, engine.info.model_name)
    try:
        code = _serve(conn, engine, config)
    except Exception as exc:
        _send_quietly(
            conn, WorkerError(message=str(exc), kind=type(exc).__name__, during_load=False)
        )
        raise
    sys.exit(code)


def _serve(conn: Connection, engine: Any, config: WorkerConfig) -> int:
    """The loop: receive -> step -> send outputs (and the step's engine events) ->
    heartbeat. Returns an exit code."""
    interval_s = config.heartbeat_interval_s
    # Engines without events (tests' fakes) are served as well.
    drain_events = getattr(engine, "drain_events", None)
    next_beat = 0.0
    while True:
        now = time.monotonic()
        if now >= next_beat:
            conn.send_bytes(encode(Heartbeat(stats=engine.stats())))
            next_beat = now + interval_s
            if os.getppid() != config.parent_pid:
                return EXIT_PARENT_GONE
        # Block only when idle: with work queued, poll and go straight to the step.
        timeout = 0.0 if engine.has_work() else max(0.0, next_beat - time.monotonic())
        try:
            if conn.poll(timeout):
                code = _receive(conn, engine)
                if code is not None:
                    return code
        except (EOFError, OSError):
            return EXIT_OK  # the service closed the pipe: it is gone or wants us gone
        if engine.has_work():
            outputs = engine.step()
            if outputs:
                conn.send_bytes(encode(Outputs(outputs)))
            if drain_events is not None:
                events = drain_events()
                if events:
                    conn.send_bytes(encode(EngineEvents(list(events))))


def _receive(conn: Connection, engine: Any) -> int | None:
    """Handle every message waiting on the pipe; an exit code means stop."""
    while True:
        message = to_worker_decoder.decode(conn.recv_bytes())
        if isinstance(message, GenerateRequest):
            try:
                engine.add_request(message)
            except RequestRejected as exc:
                conn.send_bytes(
                    encode(
                        Rejected(
                            request_id=message.request_id,
                            message=exc.message,
                            code=exc.code,
                            param=exc.param,
                        )
                    )
                )
        elif isinstance(message, AbortRequest):
            engine.abort(message.request_id)
        elif isinstance(message, StatsRequest):
            conn.send_bytes(encode(Heartbeat(stats=engine.stats(), seq=message.seq)))
        elif isinstance(message, Shutdown):
            return EXIT_OK
        if not conn.poll(0):
            return None


def _make_engine(config: WorkerConfig) -> Any:
    """Import and call ``config.engine_factory`` (``"module:callable"``) here, in the
    worker, so torch is imported by this process only."""
    module_name, _, attr = config.engine_factory.partition(":")
    factory = getattr(importlib.import_module(module_name), attr or "Engine")
    return factory(config.engine)


def _redirect_output(log_conn: Connection) -> None:
    """Point fds 1 and 2 at the service's log pipe, so C-level output (CUDA, Triton)
    is captured as well as Python's; line buffering keeps lines whole and timely."""
    fd = log_conn.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the parent dies (a SIGKILLed service runs no
    cleanup). Elsewhere the pipe's EOF and the parent-pid check do the job."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the pipe closing")


def _send_quietly(conn: Connection, message: WorkerError) -> None:
    try:
        conn.send_bytes(encode(message))
    except (OSError, ValueError):
        pass
