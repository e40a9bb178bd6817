"""When to restart a worker that ended, and when to give up: backoff and crash loop.

Restarts back off exponentially from ``backoff_initial_s`` up to ``backoff_max_s``
(seconds); a worker that ran well (ready for over a minute) starts the backoff over.
``max_exits`` exits within ``exit_window_s`` seconds are a crash loop: the supervisor
moves to ``failed``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# A worker ready this long (seconds) before it ended ran well: the backoff starts over.
RAN_WELL_S = 60.0


@dataclass(frozen=True)
class RestartLimits:
    """The backoff and the crash loop's bounds (see the module docstring); seconds."""

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_exits: int = 5
    exit_window_s: float = 60.0


class RestartPolicy:
    """The exit history of one supervisor under ``limits``; times are
    ``time.monotonic()`` seconds."""

    def __init__(self, limits: RestartLimits) -> None:
        self.limits = limits
        self._exits: deque[float] = deque()
        self._consecutive = 0

    def clear(self) -> None:
        """Forget the history (a restart asked for by hand)."""
        self._exits.clear()
        self._consecutive = 0

    def record_exit(self, now: float, ready_for_s: float | None) -> None:
        """One worker ended at ``now``; ``ready_for_s``: how long it had been ready
        (None: it never was)."""
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.limits.exit_window_s:
            self._exits.popleft()
        if ready_for_s is not None and ready_for_s > RAN_WELL_S:
            self._consecutive = 0
        self._consecutive += 1

    @property
    def recent_exits(self) -> int:
        """Exits within the window."""
        return len(self._exits)

    @property
    def crash_loop(self) -> bool:
        """Whether the exits within the window reach ``max_exits``."""
        return len(self._exits) >= self.limits.max_exits

    def delay_s(self) -> float:
        """Seconds to wait before the next worker."""
        limits = self.limits
        return min(limits.backoff_max_s, limits.backoff_initial_s * 2 ** (self._consecutive - 1))
