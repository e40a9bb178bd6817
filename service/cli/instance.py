"""One ``headroom serve`` per user, and how others find it.

:func:`take_lock` holds an exclusive lock on ``serve.lock`` in the runtime dir (the
folder of the stale-worker list, :func:`service.supervision.stale.default_pidfile`:
platformdirs' user runtime dir, or ``HEADROOM_RUNTIME_DIR``) for the life of the
process; the operating system drops it when the process ends, however it ends, so a
crash never leaves a stale lock. A second ``headroom serve`` fails to take it and names
where the first listens, read from ``runtime.json`` in the same folder:
``{"pid", "host", "port", "url", "version", "token_file", "started_at"}`` (Unix
seconds), written atomically (a temporary file renamed over it) once the port is bound,
and removed at exit. A desktop app reads it to find the service; ``headroom status``
reads it and asks the service, and ``headroom doctor`` and ``headroom token`` take
its address from it (:func:`service_address`).

Light at import (no Litestar, no torch), like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from service.common.token import service_url
from service.common.version import headroom_version

LOCK_NAME = "serve.lock"
RUNTIME_NAME = "runtime.json"


def runtime_dir() -> Path:
    """The folder of the lock and ``runtime.json`` (created, owner-only)."""
    from service.supervision.stale import default_pidfile

    return default_pidfile().parent


class AlreadyRunning(Exception):
    """Another ``headroom serve`` holds the lock; ``info`` is its ``runtime.json`` (None
    while it has not written one yet)."""

    def __init__(self, info: dict[str, Any] | None) -> None:
        where = f" on {info['url']} (pid {info['pid']})" if info else ""
        super().__init__(
            f"headroom is already running{where}; use that one, or stop it first "
            "(`headroom status` asks it how it is); a second one beside it needs its own "
            "HEADROOM_RUNTIME_DIR and port"
        )
        self.info = info


def _try_lock(handle: IO[str]) -> bool:
    if sys.platform == "win32":  # pragma: no cover - Windows
        import msvcrt

        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def take_lock(folder: Path | None = None) -> IO[str]:
    """Take the single-instance lock; keep the returned file open for the process's life.

    Raises:
        AlreadyRunning: another process holds it.
    """
    folder = folder or runtime_dir()
    handle = open(folder / LOCK_NAME, "a+")  # noqa: SIM115 - held until the process ends
    if not _try_lock(handle):
        handle.close()
        raise AlreadyRunning(read_runtime(folder))
    return handle


def release_lock(handle: IO[str]) -> None:
    """Remove the lock file and let it go, at exit: the service leaves nothing in the
    runtime dir (a starter that opened the old file in between locks that one alone)."""
    with contextlib.suppress(OSError):
        Path(handle.name).unlink()
    handle.close()


def running(folder: Path | None = None) -> dict[str, Any] | None:
    """The running service's ``runtime.json``, or None when none runs (nobody holds the
    lock: a file left by a killed one is stale and ignored)."""
    folder = folder or runtime_dir()
    try:
        handle = take_lock(folder)
    except AlreadyRunning as exc:
        return exc.info
    handle.close()
    return None


def service_address(host: str, port: int) -> tuple[str, int, dict[str, Any] | None]:
    """Where headroom listens: the running service's host and port (its
    ``runtime.json``), else ``host`` and ``port`` (the configured ones).

    Returns:
        ``(host, port, info)``: ``info`` is the running service's ``runtime.json``, or
        None when none runs (or it has not written one yet).
    """
    info = running()
    if info is not None and isinstance(info.get("host"), str) and isinstance(info.get("port"), int):
        return info["host"], info["port"], info
    return host, port, None


def read_runtime(folder: Path | None = None) -> dict[str, Any] | None:
    """``runtime.json``'s content, or None when absent or unreadable."""
    path = (folder or runtime_dir()) / RUNTIME_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_runtime(host: str, port: int, token_file: Path, folder: Path | None = None) -> Path:
    """Write ``runtime.json`` atomically (owner-only) for this process; returns its path."""
    folder = folder or runtime_dir()
    info = {
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "url": service_url(host, port),
        "version": headroom_version(),
        "token_file": str(token_file),
        "started_at": time.time(),
    }
    path = folder / RUNTIME_NAME
    scratch = folder / f".{RUNTIME_NAME}.{os.getpid()}"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(info, out, indent=2)
    os.replace(scratch, path)
    return path


def remove_runtime(folder: Path | None = None) -> None:
    """Remove ``runtime.json`` if this process wrote it."""
    info = read_runtime(folder)
    if info is not None and info.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            ((folder or runtime_dir()) / RUNTIME_NAME).unlink()
