"""The supervisor's states, the refusal they cause, and the codes of ended sequences.

``starting`` (first spawn) -> ``ready`` -> ``restarting`` (worker died or hung; back to
``ready``) ... -> ``failed`` (a crash loop, or the first load failed), and ``stopped``
at shutdown. While not ``ready``, new work is refused with :class:`NotReady` (HTTP 503
+ Retry-After).
"""

from __future__ import annotations

import enum

ENGINE_RESTARTED = "engine_restarted"
ENGINE_FAILED = "engine_failed"
SHUTTING_DOWN = "server_shutting_down"
SHUTDOWN_MESSAGE = "the server is shutting down; this request was ended before it finished"


def first_line(text: str) -> str:
    """One log line of a many-line message (a plan's misfit and its fixes); the whole
    text is in the health report and in the start-up failure."""
    first, _, rest = text.partition("\n")
    return f"{first} (...)" if rest.strip() else first


class State(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class NotReady(Exception):
    """No worker can take work now.

    Attributes:
        state: the supervisor's state.
        retry_after_s: seconds after which retrying makes sense, or None (``failed``).
        reason: why, for ``failed``.
    """

    def __init__(self, state: State, retry_after_s: int | None, reason: str | None) -> None:
        what = {
            State.STARTING: "the engine is starting",
            State.RESTARTING: "the engine is restarting",
            State.FAILED: "the engine has failed",
            State.STOPPED: "the server is shutting down",
        }.get(state, "the engine is not ready")
        message = what + (f": {reason}" if reason else "")
        if retry_after_s is not None:
            message += f"; retry in {retry_after_s} s"
        super().__init__(message)
        self.message = message
        self.state = state
        self.retry_after_s = retry_after_s
        self.reason = reason
