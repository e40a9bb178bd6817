"""The supervisor's knobs (:class:`SupervisorConfig`), with the worker's config inside."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.wire.ipc import WorkerConfig
from service.supervision.restarts import RestartLimits
from service.supervision.waits import (
    DEFAULT_MEMORY_SETTLE_S,
    GPU_RETRY_INITIAL_S,
    GPU_RETRY_MAX_S,
)


@dataclass(frozen=True)
class SupervisorConfig:
    """Knobs of the supervisor; times in seconds.

    ``stall_timeout_s``: a ready worker silent this long (no heartbeat), or whose step
    made no progress this long (:mod:`service.supervision.liveness`), is killed and
    restarted. ``start_timeout_s``: a worker not ready this long after spawning is
    killed. ``restart_limits``: the backoff between restarts and how many exits in
    how long are a crash loop (-> ``failed``).
    ``pidfile``: the stale-worker list (None: :func:`service.supervision.stale.default_pidfile`);
    ``guard_workers`` False skips it (no reaping, no recording). ``release_timeout_s``:
    the longest wait for a dead worker's memory before a new one plans.
    ``memory_settle_s``: in ``waiting_for_memory``, how long the free memory must stay
    sufficient before the worker starts. ``keep_alive_s``: unload the worker after this
    long without requests (``idle``; None: never). ``load_on_request``: a request wakes
    a ``paused`` worker (instead of a 503). ``gpu_retry_initial_s`` doubles up to
    ``gpu_retry_max_s`` between tries in ``waiting_for_gpu``.
    """

    worker: WorkerConfig
    stall_timeout_s: float = 30.0
    start_timeout_s: float = 900.0
    restart_limits: RestartLimits = RestartLimits()
    pidfile: Path | None = None
    guard_workers: bool = True
    release_timeout_s: float = 10.0
    memory_settle_s: float = DEFAULT_MEMORY_SETTLE_S
    keep_alive_s: float | None = None
    load_on_request: bool = False
    gpu_retry_initial_s: float = GPU_RETRY_INITIAL_S
    gpu_retry_max_s: float = GPU_RETRY_MAX_S
