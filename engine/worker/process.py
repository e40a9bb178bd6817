"""The engine worker process: loads the engine, then serves the service over a pipe.

Started by the service's supervisor with multiprocessing's *spawn* start method (a
fresh interpreter: no CUDA state, no event loop, no Litestar inherited from the
service). :func:`worker_main` is the process target. The engine is driven by one
thread, as it requires: drain the pipe, run one engine step, send its outputs. The
service's replan commands (:class:`engine.wire.ipc.ResizePool` and the others) arrive on the
same pipe and are carried out there, between two steps: the engine is never resized
mid-step.

With ``--tensor-parallel-size N`` this process is rank 0 of a group of N
(:mod:`engine.worker.tp_launch`): it spawns the other ranks as its children and the
service still sees one worker; a lost rank ends the group (exit code 5) and the
supervisor restarts it as after any worker death.

Heartbeats come from a thread of their own (:mod:`engine.worker.heartbeat`), so a long
step still beats; they carry the work counter (:mod:`engine.common.progress`) that the
layers of a step and each pass of the loop advance, so the service's watchdog kills a
worker whose step is stuck, not one whose step is long.

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
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.common import progress
from engine.common.errors import CudaUnavailable, PlanDoesNotFit, RequestRejected, SettingRefused
from engine.common.load_errors import ModelLoadError
from engine.common.parent_death import die_with_parent
from engine.common.units import count_of
from engine.loader.convert_child import convert_ahead
from engine.loader.resolve import resolve_model
from engine.memory.kv_fit import usable_pages
from engine.memory.plan import MIN_PREFILL_TOKENS, fmt_bytes
from engine.wire.ipc import (
    ENGINE_FACTORY,
    ControlDone,
    EngineEvents,
    EvictPrefixCache,
    Misfit,
    ModelFolder,
    MoveLayers,
    Outputs,
    PoolStats,
    Ready,
    Rejected,
    ResizeExpertCache,
    ResizePool,
    SetPrefillChunk,
    Shutdown,
    StatsRequest,
    WorkerConfig,
    WorkerError,
    decode_to_worker,
)
from engine.wire.messages import AbortRequest, GenerateRequest, ResizeResult
from engine.worker.heartbeat import HeartbeatThread, SharedPipe
from engine.worker.kept_pool import take_kept_pool

log = logging.getLogger("headroom.worker")

# Exit codes the supervisor reads.
EXIT_OK = 0
EXIT_LOAD_FAILED = 3
EXIT_PARENT_GONE = 4


def worker_main(conn: Connection, config: WorkerConfig, log_conn: Connection | None) -> None:
    """Process target: run the worker until the service says stop or goes away.

    Args:
        conn: this end of the duplex pipe; frames are msgpack (:mod:`engine.wire.ipc`).
        config: the frozen start config.
        log_conn: write end of a one-way pipe whose fd becomes this process's stdout
            and stderr, so the service can prefix and log everything printed here
            (tracebacks of a crash included). ``None`` leaves them as inherited.

    Exits with 0 on :class:`engine.wire.ipc.Shutdown` or when the pipe closes, 3 when the
    engine fails to load (a missing model, a memory plan that does not fit...), 4 when
    the parent is gone; an error in a step propagates (exit code 1) after a
    :class:`engine.wire.ipc.WorkerError` is sent.
    """
    if log_conn is not None:
        _redirect_output(log_conn)
    _ignore_group_signals(config.parent_pid)
    _die_with_parent()
    if os.getppid() != config.parent_pid:
        # The parent died between spawning us and the prctl call above.
        sys.exit(EXIT_PARENT_GONE)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    started = time.monotonic()
    pipe = SharedPipe(conn)
    try:
        engine = _make_engine(config, pipe)
    except Exception as exc:  # every load failure is reported, then we exit
        if isinstance(exc, (PlanDoesNotFit, ModelLoadError, CudaUnavailable, SettingRefused)):
            # Expected, and their messages say what to do (the service shows them in
            # full): one line, no traceback.
            log.error("the engine cannot start: %s", str(exc).partition("\n")[0])
        else:
            traceback.print_exc()
        misfit = _misfit(exc.plan) if isinstance(exc, PlanDoesNotFit) else None
        _send_quietly(
            pipe,
            WorkerError(message=str(exc), kind=type(exc).__name__, during_load=True, misfit=misfit),
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LOAD_FAILED)
    # A live size kept for this worker: taken before Ready, whose info names the pool.
    take_kept_pool(engine, config.kv_pages, pool_stats(engine, engine.stats(), 0) if config.kv_pages else None)
    load_s = time.monotonic() - started
    group = getattr(engine, "tp_group", None)
    rank_pids = group.pids[1:] if group is not None else []
    pipe.send(Ready(info=engine.info, pid=os.getpid(), load_s=load_s, rank_pids=rank_pids))
    drain = getattr(engine, "drain_events", None)
    if drain is not None and (events := drain()):
        pipe.send(EngineEvents(list(events)))  # the kept size's replan
    log.info("engine ready in %.1f s: %s", load_s, engine.info.model_name)
    try:
        code = _serve(pipe, engine, config)
    except Exception as exc:
        _send_quietly(
            pipe, WorkerError(message=str(exc), kind=type(exc).__name__, during_load=False)
        )
        raise
    group = getattr(engine, "tp_group", None)
    if group is not None:
        from engine.worker.tp_launch import stop_group

        stop_group(group)
    # Nothing is left to write: skip the interpreter's teardown of the engine's tensors
    # and torch's exit hooks (half a second of a service's stop or restart).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(pipe: SharedPipe, engine: Any, config: WorkerConfig) -> int:
    """The loop: receive -> step -> send outputs (and the step's engine events), with
    the heartbeat thread beside it. Returns an exit code."""
    interval_s = config.heartbeat_interval_s
    # Engines without events (tests' fakes) are served as well.
    drain_events = getattr(engine, "drain_events", None)
    # The pool to grow back to: the memory plan's (larger when the plan lowered the
    # context: one request of the context asked for).
    planned_pages = 0
    if hasattr(engine, "resize_kv_pool"):
        planned_pages = getattr(engine, "kv_pool_ceiling_pages", engine.pool.num_pages)
    threads = _cpu_threads(config)
    stats = engine.stats()
    beats = HeartbeatThread(pipe, interval_s, stats, pool_stats(engine, stats, planned_pages))
    beats.start()
    next_reading = time.monotonic() + interval_s
    try:
        while True:
            progress.advance()  # a pass of the loop is progress (a replayed graph runs no layer loop)
            now = time.monotonic()
            if now >= next_reading:  # the engine's figures, for the next beats
                stats = engine.stats()
                beats.update(stats, pool_stats(engine, stats, planned_pages))
                next_reading = now + interval_s
                if os.getppid() != config.parent_pid:
                    return EXIT_PARENT_GONE
            # Block only when idle: with work queued, poll and go straight to the step.
            timeout = 0.0 if engine.has_work() else max(0.0, next_reading - time.monotonic())
            try:
                beats.waiting = timeout > 0
                ready = pipe.poll(timeout)
                beats.waiting = False
                if ready:
                    code = _receive(pipe, engine, beats, planned_pages)
                    if code is not None:
                        return code
            except (EOFError, OSError):
                return EXIT_OK  # the service closed the pipe: it is gone or wants us gone
            if engine.has_work():
                threads()
                outputs = engine.step()
                if outputs:
                    pipe.send(Outputs(outputs))
                if drain_events is not None:
                    events = drain_events()
                    if events:
                        pipe.send(EngineEvents(list(events)))
    finally:
        beats.stop()


def _cpu_threads(config: WorkerConfig) -> Callable[[], None]:
    """torch's CPU thread count, set now and then fitted between steps to the cores other
    programs leave free (:mod:`engine.worker.cpu_threads`); returns the call for the loop."""
    if "torch" not in sys.modules:  # an engine without torch (tests' fakes)
        return lambda: None
    from engine.worker.cpu_threads import fit_between_steps

    return fit_between_steps(getattr(config.engine, "cpu_threads", "auto"))


def _receive(pipe: SharedPipe, engine: Any, beats: HeartbeatThread, planned_pages: int) -> int | None:
    """Handle every message waiting on the pipe; an exit code means stop."""
    while True:
        message = decode_to_worker(pipe.recv_bytes())
        if isinstance(message, Rejected):  # a frame no request could be made of
            pipe.send(message)
        elif isinstance(message, GenerateRequest):
            try:
                engine.add_request(message)
            except RequestRejected as exc:
                pipe.send(
                    Rejected(request_id=message.request_id, message=exc.message, code=exc.code, param=exc.param)
                )
        elif isinstance(message, AbortRequest):
            engine.abort(message.request_id)
        elif isinstance(message, StatsRequest):
            stats = engine.stats()  # read now, and kept for the next beats
            beats.update(stats, pool_stats(engine, stats, planned_pages))
            pipe.send(beats.beat(message.seq))
        elif isinstance(message, (SetPrefillChunk, EvictPrefixCache, ResizePool, ResizeExpertCache, MoveLayers)):
            _replan(pipe, engine, message, planned_pages)
        elif isinstance(message, Shutdown):
            return EXIT_OK
        if not pipe.poll(0):
            return None


def pool_stats(engine: Any, stats: Any, planned_pages: int) -> PoolStats | None:
    """What the service's replan controller needs of the engine's memory, or None for an
    engine that cannot resize its pool (tests' fakes). ``stats`` is ``engine.stats()``
    read now; ``planned_pages`` the pool the engine was loaded with.

    On a planned engine, page and fixed sizes are the plan's (a simulated card counts
    bytes as the plan does, whatever the CPU pool really holds); otherwise the pool's.
    The expert cache's figures are the plan's too (slot bytes, planned slots), its slots
    now the engine's; all 0 without routed experts in host memory.
    """
    if not hasattr(engine, "resize_kv_pool"):
        return None
    plan = getattr(engine, "plan", None)
    page_bytes, fixed, per_token = engine.kv_page_bytes, 0, 0
    stores = getattr(engine, "expert_stores", [])
    max_slots = getattr(engine, "max_expert_cache_slots", 0)
    slot_bytes = stores[0].slot_bytes if stores else 0
    planned_slots = 0  # routed experts go to host memory only by a plan's choice
    if plan is not None and plan.num_pages > 0:
        page_bytes = max(plan.kv_pool_bytes // plan.num_pages, 1)
        fixed = plan.fixed_bytes
        peak = next((e.bytes for e in plan.ledger if e.name == "prefill activation peak"), 0)
        per_token = peak // max(plan.max_prefill_tokens, 1)
        if stores:
            planned_slots = min(plan.expert_cache_slots, max_slots)
            slot_bytes = plan.expert_slot_bytes or slot_bytes
    return PoolStats(
        pages=engine.pool.num_pages,
        planned_pages=planned_pages,
        min_pages=engine.min_kv_pool_pages(),
        page_bytes=page_bytes,
        pool_bytes=engine.pool.nbytes,
        prefill_chunk=engine.scheduler.max_prefill_tokens,
        planned_prefill_chunk=engine.knobs.max_prefill_tokens,
        min_prefill_chunk=MIN_PREFILL_TOKENS,
        activation_bytes_per_token=per_token,
        free_pages=stats.free_pages,
        cached_pages=stats.cached_pages,
        max_context_tokens=engine.max_context_tokens,
        fixed_bytes=fixed,
        expert_slots=getattr(engine, "expert_cache_slots", 0),
        planned_expert_slots=planned_slots,
        max_expert_slots=max_slots,
        expert_slot_bytes=slot_bytes,
        ring=getattr(engine, "ring_rule", None),
        **_split_stats(engine),
    )


def _split_stats(engine: Any) -> dict[str, int]:
    """:class:`PoolStats`' split fields (``Engine.move_split``); only the model's decoder
    and mixture-of-experts layers for an engine whose split cannot move."""
    model = getattr(engine, "model_config", None)
    layers = {"decoder_layers": getattr(model, "num_layers", 0),
              "moe_layers": len(model.moe_layers) if getattr(model, "is_moe", False) else 0}
    most = getattr(engine, "max_cpu_layers", 0)
    if not most:
        return layers
    return dict(**layers, cpu_layers=engine.cpu_layers, planned_cpu_layers=engine.planned_cpu_layers, max_cpu_layers=most,
                layer_bytes=max(engine.layer_device_bytes), device_layers=engine.pool.num_layers)


def _replan(pipe: SharedPipe, engine: Any, command: Any, planned_pages: int) -> None:
    """Carry out one replan command between steps; send the engine's events (the
    ``Replanned``), then a :class:`ControlDone`. A command the engine cannot take (a
    fake engine, a size below 2 pages, a grow that ran out of device memory: the pool
    then stays consistent at its old size) is answered ``ok=False``; any other error
    propagates and ends the worker."""
    ok, result = True, None
    why = {"reason": command.reason, "origin": command.origin}
    try:
        if not hasattr(engine, "resize_kv_pool"):
            ok, text = False, "this engine cannot change its memory use while it runs"
        elif isinstance(command, SetPrefillChunk):
            after = engine.set_prefill_chunk(command.tokens, **why)
            text = f"prefill chunk cap {after} tokens"
        elif isinstance(command, EvictPrefixCache):
            freed = engine.evict_prefix_cache(**why)
            text = f"{freed} prefix-cache pages freed"
        elif isinstance(command, MoveLayers):
            if not hasattr(engine, "move_split"):
                raise ValueError("this engine cannot move its split between the device and the CPU")
            before = engine.cpu_layers
            after = engine.move_split(command.cpu_layers, **why)
            text = f"decoder layers on the CPU {before} -> {after}"
        elif isinstance(command, ResizeExpertCache):
            if not hasattr(engine, "resize_expert_cache"):
                raise ValueError("this engine has no expert cache to resize")
            before = engine.expert_cache_slots
            freed = engine.resize_expert_cache(command.num_slots, **why)
            text = (f"expert cache {before} -> {engine.expert_cache_slots} slots "
                    f"({'freed' if freed >= 0 else 'took'} {fmt_bytes(abs(freed))})")
        else:
            result = engine.resize_kv_pool(command.num_pages, **why)
            text = _describe_resize(result)
    except ValueError as exc:
        ok, text = False, str(exc)
    except Exception as exc:
        if type(exc).__name__ != "OutOfMemoryError":
            raise
        # A grow (or a shrink's copy) did not fit: the pool is consistent at the size it
        # kept (engine.kvcache.pool.KVPool.resize), and the engine runs on.
        ok, text = False, f"out of device memory: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        log.warning("replan command failed: %s", text)
    drain = getattr(engine, "drain_events", None)
    events = drain() if drain is not None else []
    if events:
        pipe.send(EngineEvents(list(events)))
    stats = engine.stats()
    pool = pool_stats(engine, stats, planned_pages)
    pipe.send(ControlDone(seq=command.seq, ok=ok, message=text, stats=stats, pool=pool, result=result))


def _describe_resize(r: ResizeResult) -> str:
    """The answer to a pool resize: usable pages and their bytes, as ``headroom plan``
    prices a pool, not the buffers' (which hold the null page too)."""
    if r.after_pages == r.before_pages:
        return f"the KV pool stays at {usable_pages(r.after_pages)} pages"
    before, after = usable_pages(r.before_pages), usable_pages(r.after_pages)
    text = (
        f"KV pool {before} -> {after} pages "
        f"({fmt_bytes(r.before_kv_pool_bytes)} -> {fmt_bytes(r.after_kv_pool_bytes)}) in {r.duration_ms:.0f} ms; "
        f"context limit {r.max_context_tokens} tokens"
    )
    if r.preempted:
        text += f"; {count_of(len(r.preempted), 'request')} preempted (recomputed later)"
    if r.ended:
        text += f"; {count_of(len(r.ended), 'request')} ended"
    return text


def _misfit(plan: Any) -> Misfit:
    """The figures of a plan that does not fit, from its ledger's lines."""
    lines = {entry.name: entry.bytes for entry in plan.ledger}
    return Misfit(
        total_bytes=lines.get("device total", 0),
        others_bytes=lines.get("used by other processes", 0),
        shortfall_bytes=plan.shortfall_bytes,
        simulated=plan.simulated,
    )


def _make_engine(config: WorkerConfig, pipe: SharedPipe) -> Any:
    """Import and call ``config.engine_factory`` (``"module:callable"``) here, in the
    worker, so torch is imported by this process only. For the real engine (a stand-in
    factory of the tests loads no model) a GGUF not converted yet is converted first, in
    a child process (:func:`engine.loader.convert_child.convert_ahead`), and the model's
    folder is sent (:class:`ModelFolder`) before the weights load, so the service loads
    the tokenizer meanwhile.

    Raises:
        Whatever the factory raises; the conversion's
        :class:`~engine.common.load_errors.ModelLoadError`.
    """
    if config.engine_factory == ENGINE_FACTORY:
        convert_ahead(config.engine.model)
        pipe.send(ModelFolder(model_dir=str(resolve_model(config.engine.model))))
    module_name, _, attr = config.engine_factory.partition(":")
    factory = getattr(importlib.import_module(module_name), attr or "Engine")
    if config.engine.tensor_parallel_size == 1:
        return factory(config.engine)
    from engine.worker.tp_launch import rank_config, start_group

    group = start_group(config.engine)
    engine = factory(rank_config(config.engine, 0), tp=group.tp)
    engine.tp_group = group
    return engine


def _redirect_output(log_conn: Connection) -> None:
    """Point fds 1 and 2 at the service's log pipe, so C-level output (CUDA, Triton)
    is captured as well as Python's; line buffering keeps lines whole and timely."""
    fd = log_conn.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _ignore_group_signals(parent_pid: int) -> None:
    """The service decides when the worker stops (Shutdown, the pipe closing): a Ctrl-C
    in a terminal (SIGINT) reaches the whole process group, and a service manager may
    send SIGTERM to every process of the service; the service drains its requests
    first. So SIGINT is ignored, and SIGTERM too while the service lives; a worker whose
    service is gone (a stale one being reaped) exits on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum: int, frame: Any) -> None:
        if os.getppid() != parent_pid:
            os._exit(EXIT_PARENT_GONE)

    signal.signal(signal.SIGTERM, on_term)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the parent dies (a SIGKILLed service runs no
    cleanup). Elsewhere the pipe's EOF and the parent-pid check do the job."""
    if sys.platform.startswith("linux") and not die_with_parent():
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the pipe closing")


def _send_quietly(pipe: SharedPipe, message: WorkerError) -> None:
    try:
        pipe.send(message)
    except (OSError, ValueError):
        pass
