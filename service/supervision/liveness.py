"""Whether the current worker is alive and moving on: what the watchdog judges a stall by.

The worker beats from a thread of its own, also in the middle of a long step, and each
heartbeat carries its work counter (``engine.wire.ipc.Heartbeat.progress``: layers run,
passes of its loop). So two stalls are told apart:

- **silent**: no message at all for the stall timeout: the process is stopped
  (SIGSTOP), gone, or frozen whole;
- **stuck**: heartbeats arrive, but for the stall timeout the counter has not moved,
  no other message (outputs, an answer) came, and the worker was not waiting for work:
  a step deadlocked (in a collective of a tensor-parallel group whose other rank hangs,
  in a driver call...).

A step that is long but advancing is neither. Times are ``time.monotonic()`` seconds,
passed in, so the rules are tested with a fake clock.
"""

from __future__ import annotations

from engine.wire.ipc import FromWorker, Heartbeat


class Liveness:
    """The current worker's last signs of life.

    Attributes:
        last_message_at: when it last sent anything (or was attached, or became ready).
        last_progress_at: when it last moved on: a message other than a heartbeat, a
            heartbeat whose counter differs from the one before, or one sent while it
            waited for work.
        progress: the last heartbeat's counter (None: no heartbeat yet).
    """

    def __init__(self, now: float = 0.0) -> None:
        self.last_message_at = now
        self.last_progress_at = now
        self.progress: int | None = None

    def reset(self, now: float) -> None:
        """A new worker, or one that just became ready: alive and moving as of ``now``."""
        self.last_message_at = self.last_progress_at = now
        self.progress = None

    def heard(self, message: FromWorker, now: float) -> None:
        """``message`` arrived from the worker at ``now``."""
        self.last_message_at = now
        if not isinstance(message, Heartbeat):
            self.last_progress_at = now
            return
        if message.waiting or message.progress != self.progress:
            self.last_progress_at = now
        self.progress = message.progress

    def stall(self, now: float, timeout_s: float) -> str | None:
        """Why the worker counts as hung at ``now`` under a stall timeout of
        ``timeout_s`` seconds (a sentence for the log), or None while it does not."""
        silent_s = now - self.last_message_at
        if silent_s > timeout_s:
            return f"sent no heartbeat for {silent_s:.1f} s"
        stuck_s = now - self.last_progress_at
        if stuck_s > timeout_s:
            return f"made no progress for {stuck_s:.1f} s though its heartbeats arrive (a stuck step)"
        return None
