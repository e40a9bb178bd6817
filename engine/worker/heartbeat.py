"""The worker's heartbeat, sent from a thread of its own so a long step still beats.

The main loop (:mod:`engine.worker.process`) runs engine steps; a step of a model
larger than the card may take tens of seconds. :class:`HeartbeatThread` sends a
:class:`engine.wire.ipc.Heartbeat` every heartbeat interval whatever the main loop
does, carrying the work counter (:mod:`engine.common.progress`) so the service's
watchdog can tell a long step (the counter moves) from a stuck one (it does not), and a
stopped or dead process (no heartbeat at all).

The engine is not thread-safe, so this thread never calls it: the main loop hands it
the engine's counters and pool figures between steps (:meth:`HeartbeatThread.update`).
Both threads send on the same pipe, through :class:`SharedPipe`'s lock, so two frames
never interleave.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from engine.common import progress
from engine.wire.ipc import FromWorker, Heartbeat, PoolStats, encode
from engine.wire.messages import EngineStats


class SharedPipe:
    """The worker's end of the service's pipe, shared by the main loop and the
    heartbeat thread: each frame is encoded and sent under one lock. Receiving stays
    the main loop's alone."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: FromWorker) -> None:
        """Send one message as one frame.

        Raises:
            OSError, ValueError: the pipe is closed (the service is gone).
        """
        with self._lock:
            self.conn.send_bytes(encode(message))

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def recv_bytes(self) -> bytes:
        return self.conn.recv_bytes()


class HeartbeatThread:
    """Beats every ``interval_s`` seconds on ``pipe`` from a daemon thread, the first
    beat at :meth:`start`.

    Args:
        pipe: the shared pipe.
        interval_s: seconds between beats.
        stats, pool: the engine's counters and pool figures to send until the first
            :meth:`update`.
    """

    def __init__(self, pipe: SharedPipe, interval_s: float, stats: EngineStats, pool: PoolStats | None) -> None:
        self._pipe = pipe
        self._interval_s = interval_s
        self._reading: tuple[EngineStats, PoolStats | None] = (stats, pool)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="headroom-heartbeat", daemon=True)
        self.waiting = False

    def start(self) -> None:
        self._thread.start()

    def update(self, stats: EngineStats, pool: PoolStats | None) -> None:
        """The main loop's new reading of the engine, sent from the next beat on."""
        self._reading = (stats, pool)  # one reference swapped: atomic under the GIL

    def beat(self, seq: int | None = None) -> Heartbeat:
        """The heartbeat to send now (``seq``: the :class:`engine.wire.ipc.StatsRequest`
        it answers)."""
        stats, pool = self._reading
        return Heartbeat(stats=stats, seq=seq, pool=pool, progress=progress.read(), waiting=self.waiting)

    def stop(self) -> None:
        """End the thread (it may be in a send: waited for at most one interval)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self._interval_s, 1.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._pipe.send(self.beat())
            except (OSError, ValueError):
                return  # the pipe closed: the main loop sees it and ends the worker
            self._stop.wait(self._interval_s)

