"""The supervisor's states, the refusal they cause, and the codes of ended sequences.

``starting`` (first spawn, or a load after ``paused`` or ``idle``) -> ``ready`` ->
``restarting`` (worker died or hung, or a restart was asked for; back to ``ready``) ...
-> ``failed`` (a crash loop, or the first load failed), and ``stopped``
at shutdown. Without a worker, and without failing:

- ``waiting_for_memory``: the plan does not fit because other processes hold memory (it
  would fit on the card without them); the worker starts once the VRAM source shows
  enough free memory for the settle time.
- ``waiting_for_gpu``: CUDA cannot be initialised on a machine with a GPU (or the
  worker died of a CUDA error that is not an out-of-memory); retried with backoff.
- ``paused``: game mode, asked for through ``/api/control/pause``; the worker is
  stopped and its memory given back until ``/api/control/resume`` (or, with
  ``--load-on-request``, a request).
- ``idle``: unloaded after ``--keep-alive`` without requests; the next request loads
  the worker again and waits for it.

While not ``ready``, new work is refused with :class:`NotReady` (HTTP 503 +
Retry-After), except that a request wakes an ``idle`` worker (and a ``paused`` one with
``--load-on-request``) and waits for it.
"""

from __future__ import annotations

import enum

ENGINE_RESTARTED = "engine_restarted"
ENGINE_FAILED = "engine_failed"
ENGINE_PAUSED = "engine_paused"
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
    WAITING_FOR_MEMORY = "waiting_for_memory"
    WAITING_FOR_GPU = "waiting_for_gpu"
    PAUSED = "paused"
    IDLE = "idle"


# States without a worker that are not failures: the service waits, and says why.
UNLOADED = frozenset({State.WAITING_FOR_MEMORY, State.WAITING_FOR_GPU, State.PAUSED, State.IDLE})


# How a paused engine is loaded again, said once in whatever names the pause.
RESUME_ROUTE = "POST /api/control/resume"
RESUME_HINT = f"{RESUME_ROUTE} resumes it"
# How a failed engine (a crash loop after the first start) is started again: only a
# restart does it (a resume answers 409 naming it).
RESTART_ROUTE = "POST /api/control/restart"
RESTART_HINT = f"{RESTART_ROUTE} (or restarting the service) starts it again"


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
            State.WAITING_FOR_MEMORY: "the engine is waiting for GPU memory",
            State.WAITING_FOR_GPU: "the engine is waiting for the GPU",
            State.PAUSED: "the engine is paused",
            State.IDLE: "the engine is unloaded",
        }.get(state, "the engine is not ready")
        head, word = what.rsplit(" ", 1)
        if reason and reason.startswith(f"{word} "):  # "paused through ...": the state said once
            message = f"{head} {reason}"
        else:
            message = what + (f": {reason}" if reason else "")
        if state is State.PAUSED and RESUME_ROUTE not in message:
            message += f" ({RESUME_HINT})"
        if retry_after_s is not None:
            message += f"; retry in {retry_after_s} s"
        super().__init__(message)
        self.message = message
        self.state = state
        self.retry_after_s = retry_after_s
        self.reason = reason
