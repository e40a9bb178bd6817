"""The supervisor's knobs (:class:`SupervisorConfig`), with the worker's config inside."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.ipc import WorkerConfig


@dataclass(frozen=True)
class SupervisorConfig:
    """Knobs of the supervisor; times in seconds.

    ``stall_timeout_s``: a ready worker silent this long (no heartbeat) is killed and
    restarted. ``start_timeout_s``: a worker not ready this long after spawning is
    killed. ``backoff_initial_s`` doubles per consecutive exit up to ``backoff_max_s``;
    ``max_exits`` exits within ``exit_window_s`` mean a crash loop -> ``failed``.
    ``pidfile``: the stale-worker list (None: :func:`service.supervision.stale.default_pidfile`);
    ``guard_workers`` False skips it (no reaping, no recording). ``release_timeout_s``:
    the longest wait for a dead worker's memory before a new one plans.
    """

    worker: WorkerConfig
    stall_timeout_s: float = 30.0
    start_timeout_s: float = 900.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_exits: int = 5
    exit_window_s: float = 60.0
    pidfile: Path | None = None
    guard_workers: bool = True
    release_timeout_s: float = 10.0
