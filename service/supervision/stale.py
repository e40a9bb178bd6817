"""The restart-race guard: stale workers of an earlier run, and ghosts.

Workers die with their parent (``engine.worker.process``: parent-death signal, pipe EOF,
re-parenting check), but a worker stuck in a driver call, or one whose service was
killed between spawning it and the ``prctl``, can outlive it and keep holding VRAM. Two
helpers keep a new start from planning against that memory:

- A *pid file* (``workers.json`` in the platformdirs user runtime dir, else the user
  cache dir) lists every worker this user's services started: its pid, its start time
  and command line as ``/proc`` showed them at spawn, and its service's pid and start
  time. :func:`reap_stale_workers`, run at start, ends the workers whose service is
  gone, and nothing else: a process is ended only while ``/proc/<pid>`` still shows the
  recorded start time and command line and that command line is a headroom worker's
  (:func:`is_worker_cmdline`); it is signalled through a pidfd opened *before* that
  last check, so a pid reused in between is never hit. Anyone else's process (another
  user's, a reused pid, a lookalike with a similar name) is left alone.
- :func:`service.supervision.release.wait_for_release` waits, bounded (10 s), until
  NVML no longer shows a dead worker, so a restart never plans against a ghost.

Linux only (``/proc``); elsewhere the pid file is kept but nothing is reaped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("headroom.stale")

APP_NAME = "headroom"
PIDFILE_NAME = "workers.json"
# A worker is started by multiprocessing's *spawn* method (service.supervision.worker_process):
# ``<python> -c "from multiprocessing.spawn import spawn_main; spawn_main(...)"
# --multiprocessing-fork``. A worker run as ``python -m engine.worker.process`` also counts.
SPAWN_FLAG = "--multiprocessing-fork"
SPAWN_CALL = "spawn_main"
WORKER_MODULE = "engine.worker.process"

# Outcomes of reap_stale_workers, per pid-file entry.
ENDED = "ended"  # a stale worker; it was signalled and is gone
GONE = "gone"  # no such process any more: the entry is dropped
LEFT_ALONE = "left alone"  # not (or no longer) our stale worker: never signalled
STILL_RUNNING = "still running"  # a stale worker that survived SIGKILL (stuck in the driver)


def default_pidfile() -> Path:
    """``<user runtime dir>/headroom/workers.json`` (``$XDG_RUNTIME_DIR`` on Linux);
    the user cache dir when the runtime dir cannot be made or written.
    ``HEADROOM_RUNTIME_DIR`` names the folder instead (tests, several installs)."""
    import platformdirs

    from engine.common.environment import RUNTIME_DIR
    from service.common.paths import RuntimeDirError, runtime_dir

    override = RUNTIME_DIR.get()
    if override:
        folder = Path(override).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            why = "a file, not a folder" if folder.exists() else exc.strerror or str(exc)
            raise RuntimeDirError(f"HEADROOM_RUNTIME_DIR={override!r} cannot be headroom's runtime folder "
                                  f"({why}): set it to a folder you can write, or unset it") from None
        return folder / PIDFILE_NAME
    for make in (runtime_dir, lambda: platformdirs.user_cache_dir(APP_NAME)):
        try:
            folder = Path(make())
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            if os.access(folder, os.W_OK):
                return folder / PIDFILE_NAME
        except OSError:
            continue
    return Path(platformdirs.user_cache_dir(APP_NAME)) / PIDFILE_NAME


# -- /proc ---------------------------------------------------------------------------------


def read_cmdline(pid: int) -> list[str] | None:
    """The process's argv from ``/proc/<pid>/cmdline``; None when it is gone (or a
    zombie, or a kernel thread)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return None
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: field 3 (state) is index 0."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field
    22): with the pid, it names one process for good (pids are reused, this is not)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: its memory is the driver's to free)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X", "x")


def _owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def is_worker_cmdline(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a headroom worker's command line: a Python interpreter run by
    multiprocessing's spawn method (``-c "...spawn_main(...)" --multiprocessing-fork``),
    or one running ``-m engine.worker.process``. Never true of another program with a similar
    name (``headroom-worker``, ``headroom_worker_lookalike.py``)."""
    if len(argv) < 2 or "python" not in os.path.basename(argv[0]).lower():
        return False
    args = list(argv[1:])
    if SPAWN_FLAG in args and "-c" in args:
        code = args[args.index("-c") + 1] if args.index("-c") + 1 < len(args) else ""
        return "from multiprocessing.spawn import" in code and SPAWN_CALL in code
    return (
        "-m" in args
        and args.index("-m") + 1 < len(args)
        and args[args.index("-m") + 1] == WORKER_MODULE
    )


# -- the pid file --------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRecord:
    """One pid-file entry: a worker as it was at spawn, and its service."""

    pid: int
    start_time: int | None
    cmdline: tuple[str, ...]
    service_pid: int
    service_start_time: int | None
    recorded_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "cmdline": list(self.cmdline),
            "service_pid": self.service_pid,
            "service_start_time": self.service_start_time,
            "recorded_at": self.recorded_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkerRecord:
        return cls(
            pid=int(d["pid"]),
            start_time=None if d.get("start_time") is None else int(d["start_time"]),
            cmdline=tuple(str(a) for a in d.get("cmdline") or ()),
            service_pid=int(d.get("service_pid", 0)),
            service_start_time=None
            if d.get("service_start_time") is None
            else int(d["service_start_time"]),
            recorded_at=float(d.get("recorded_at", 0.0)),
        )


@contextlib.contextmanager
def _locked(pidfile: Path) -> Iterator[None]:
    """Hold an exclusive lock on the pid file's folder (two services starting at once).
    The folder, not a lock file beside the pid file: a service that stops leaves no
    file behind, and a lock file removed under a waiting service would split the lock."""
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no folder fds to lock
        yield
        return
    fd = os.open(pidfile.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_pidfile(pidfile: Path | None = None) -> list[WorkerRecord]:
    """The entries of the pid file; empty when it is missing or unreadable (a broken
    file is logged and treated as empty: it only ever lists candidates to check)."""
    pidfile = pidfile or default_pidfile()
    try:
        data = json.loads(pidfile.read_text())
        return [WorkerRecord.from_json(d) for d in data.get("workers", [])]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the unreadable worker pid file %s: %s", pidfile, exc)
        return []


def _write(pidfile: Path, records: Sequence[WorkerRecord]) -> None:
    """Replace the pid file with ``records``; with none, remove it (a service that
    stopped cleanly leaves no runtime file)."""
    if not records:
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()
        return
    tmp = pidfile.with_name(f".{pidfile.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": 1, "workers": [r.to_json() for r in records]}, indent=1))
    os.chmod(tmp, 0o600)
    os.replace(tmp, pidfile)


def record_worker(
    pid: int, pidfile: Path | None = None, *, service_pid: int | None = None, wait_s: float = 2.0
) -> WorkerRecord:
    """Add a worker just spawned (its ``/proc`` start time and command line) to the pid
    file, with this process (or ``service_pid``) as its service. Call right after
    spawning it: ``Process.start()`` returns after the fork, maybe before the exec, so
    this waits up to ``wait_s`` for the command line to become a worker's (a fork not
    yet exec'd still shows its parent's), then records what it sees."""
    pidfile = pidfile or default_pidfile()
    spid = os.getpid() if service_pid is None else service_pid
    deadline = time.monotonic() + wait_s
    while (
        not is_worker_cmdline(read_cmdline(pid) or ())
        and time.monotonic() < deadline
        and is_alive(pid)
    ):
        time.sleep(0.005)
    rec = WorkerRecord(
        pid=pid,
        start_time=start_time(pid),
        cmdline=tuple(read_cmdline(pid) or ()),
        service_pid=spid,
        service_start_time=start_time(spid),
        recorded_at=time.time(),
    )
    with _locked(pidfile):
        records = [r for r in read_pidfile(pidfile) if r.pid != pid]
        _write(pidfile, [*records, rec])
    return rec


def forget_worker(pid: int, pidfile: Path | None = None) -> None:
    """Drop a worker that ended from the pid file."""
    pidfile = pidfile or default_pidfile()
    with _locked(pidfile):
        records = read_pidfile(pidfile)
        kept = [r for r in records if r.pid != pid]
        if len(kept) != len(records) or (not kept and pidfile.exists()):
            _write(pidfile, kept)


# -- reaping -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReapResult:
    """What :func:`reap_stale_workers` did with one pid-file entry."""

    pid: int
    outcome: str  # ENDED, GONE, LEFT_ALONE or STILL_RUNNING
    reason: str


def _same_process(rec: WorkerRecord) -> str | None:
    """Why the process now at ``rec.pid`` is not the recorded worker (None: it is)."""
    argv = read_cmdline(rec.pid)
    if argv is None or not is_alive(rec.pid):
        return "no such process"
    if rec.start_time is not None and start_time(rec.pid) != rec.start_time:
        return "the pid now belongs to a process started later"
    if tuple(argv) != rec.cmdline:
        return f"the pid now runs another command ({' '.join(argv)[:120]})"
    if not is_worker_cmdline(argv):
        return f"not a headroom worker's command line ({' '.join(argv)[:120]})"
    if _owner_uid(rec.pid) != os.getuid():
        return "owned by another user"
    return None


def _service_alive(rec: WorkerRecord) -> bool:
    """Whether the worker's service still runs: its pid alive with the recorded start
    time (a service restarted under the same pid, as PID 1 of a container, is another)."""
    if not is_alive(rec.service_pid):
        return False
    return rec.service_start_time is None or start_time(rec.service_pid) == rec.service_start_time


def _signal(pid: int, pidfd: int | None, sig: int) -> None:
    if pidfd is not None:
        signal.pidfd_send_signal(pidfd, sig)
    else:
        os.kill(pid, sig)


def _wait_gone(pid: int, timeout_s: float, sleep: Callable[[float], None]) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        sleep(0.02)
    return True


def reap_stale_workers(
    pidfile: Path | None = None,
    *,
    term_timeout_s: float = 3.0,
    kill_timeout_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> list[ReapResult]:
    """End the workers of earlier runs whose service is gone; run at start, before
    spawning a worker. Each pid-file entry is checked (see the module docstring): a
    stale worker gets SIGTERM, then SIGKILL after ``term_timeout_s``; entries of
    processes that are gone, or that are not (any more) our worker, are dropped, and
    those processes left alone; workers of a service still running are kept.

    Returns one :class:`ReapResult` per entry; each is also logged.
    """
    pidfile = pidfile or default_pidfile()
    results: list[ReapResult] = []
    with _locked(pidfile):
        keep: list[WorkerRecord] = []
        for rec in read_pidfile(pidfile):
            result = _reap_one(rec, term_timeout_s, kill_timeout_s, sleep)
            results.append(result)
            if result.outcome == STILL_RUNNING or (
                result.outcome == LEFT_ALONE and _service_alive(rec)
            ):
                keep.append(rec)
            level = logging.WARNING if result.outcome in (ENDED, STILL_RUNNING) else logging.INFO
            log.log(
                level,
                "stale worker check: pid %d %s (%s)",
                result.pid,
                result.outcome,
                result.reason,
            )
        _write(pidfile, keep)
    return results


def _reap_one(
    rec: WorkerRecord, term_timeout_s: float, kill_timeout_s: float, sleep: Callable[[float], None]
) -> ReapResult:
    if not os.path.isdir("/proc"):
        return ReapResult(rec.pid, LEFT_ALONE, "no /proc to check the process against")
    why = _same_process(rec)
    if why == "no such process":
        return ReapResult(rec.pid, GONE, why)
    if why is not None:
        return ReapResult(rec.pid, LEFT_ALONE, why)
    if _service_alive(rec):
        return ReapResult(
            rec.pid, LEFT_ALONE, f"its service (pid {rec.service_pid}) is still running"
        )
    pidfd = None
    try:
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(rec.pid)
            except ProcessLookupError:
                return ReapResult(rec.pid, GONE, "no such process")
            except OSError:
                pidfd = None  # an old kernel: fall back to kill(2)
            # Checked again with the pidfd held: the pid cannot be reused under it now.
            why = _same_process(rec)
            if why is not None:
                return ReapResult(rec.pid, GONE if why == "no such process" else LEFT_ALONE, why)
        try:
            for sig, timeout_s in ((signal.SIGTERM, term_timeout_s), (signal.SIGKILL, kill_timeout_s)):
                _signal(rec.pid, pidfd, sig)
                if _wait_gone(rec.pid, timeout_s, sleep):
                    return ReapResult(
                        rec.pid,
                        ENDED,
                        f"stale worker of service pid {rec.service_pid}, ended by {sig.name}",
                    )
        except ProcessLookupError:
            return ReapResult(rec.pid, ENDED, "it ended while being signalled")
        return ReapResult(rec.pid, STILL_RUNNING, "survived SIGKILL (stuck in the driver?)")
    finally:
        if pidfd is not None:
            os.close(pidfd)
