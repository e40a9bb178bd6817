"""The supervisor's states without a worker that are no failure, a part of
:class:`service.supervision.supervisor.Supervisor` (:mod:`service.common.engine_states`):

- ``waiting_for_memory``: the plan would fit once other processes free memory;
  :mod:`service.supervision.waits` watches the VRAM source until enough is free for
  the settle time, then a worker starts;
- ``waiting_for_gpu``: CUDA does not start, or broke; retried with backoff;
- ``paused`` (:meth:`Unloading.pause`, :meth:`Unloading.resume`): game mode, the worker
  stopped and its memory given back;
- ``idle``: unloaded after ``keep_alive_s`` without requests; the next request loads it
  again.

A worker's exit in those states is never a crash: what it carried ends (or waits for
the next worker) and the wait begins.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec

from service.common.engine_states import (
    ENGINE_PAUSED,
    ENGINE_RESTARTED,
    RESUME_HINT,
    State,
    first_line,
)
from service.supervision.report import exited_event
from service.supervision.waits import GpuBackoff, MemoryWait, sleep_or_gpu_appears, wait_for_memory
from service.supervision.worker_process import ExitStatus, WorkerProcess

if TYPE_CHECKING:
    from service.supervision.config import SupervisorConfig
    from service.supervision.inflight import InFlight
    from service.supervision.link import WorkerLink

log = logging.getLogger("headroom.supervisor")

def pause_reason(load_on_request: bool) -> str:
    """Why the engine is paused, as ``health``, the log and a refused request say it
    (:class:`service.common.engine_states.NotReady` names the state once with it)."""
    return f"paused through the control API; {RESUME_HINT}" + ("; a request resumes it" if load_on_request else "")


# Seconds a worker being unloaded (paused, idle) may take to exit before it is killed.
UNLOAD_TIMEOUT_S = 15.0

# Seconds an unload asked for by a client (Ollama's keep_alive 0) waits for the
# sequences in flight to finish before it stops the worker under them.
UNLOAD_DRAIN_TIMEOUT_S = 120.0

# The states an unload stops a worker in (loaded, or loading).
UNLOADABLE = (State.READY, State.STARTING, State.RESTARTING)


class Unloading:
    """Waiting for memory or the GPU, pausing and idling, for the supervisor; each
    state's entry, its wait, and the worker started again at its end. It calls the
    supervisor's ``_publish``, ``_publish_health``, ``_spawn_task`` and
    ``_spawn_and_publish``."""

    config: SupervisorConfig
    state: State
    link: WorkerLink
    vram_source: Any
    memory_wait: MemoryWait | None
    wait_reason: str | None
    worker_pid: int | None
    restarts: int
    last_request_at: float
    requests_waiting: Callable[[], bool]
    _worker: WorkerProcess | None
    _worker_config: Any
    _inflight: InFlight
    _waking: bool
    _resume_pending: bool
    _restart_at: float | None
    _tasks: set[asyncio.Task]
    _gpu_backoff: GpuBackoff
    # The KV pool a live change left, which the next worker starts with (None: sized as
    # at start): "N pages, SIZE".
    kept_kv_pool: str | None = None

    def keep_kv_pool(self, pages: int | None, what: str = "") -> None:
        """Start every next worker (a resume, a restart, after a crash) with a KV pool of
        ``pages`` (the whole pool, its null page included): the size a live change chose
        is the user's, as the desktop reserve is; ``what`` says it for people. It travels
        beside the start's sizing (``WorkerConfig.kv_pages``), never in its place, so the
        worker still knows the start's pool (``{"kv_cache": null}`` goes back to it) and
        re-checks the kept one against the host's memory when it loads
        (:mod:`engine.worker.kept_pool`). None: sized as the service was started
        (``--kv-cache``, ``--num-pages`` or the plan). Held in memory: a restart of the
        service goes back to its options."""
        self._worker_config = msgspec.structs.replace(self._worker_config, kv_pages=pages)
        self.kept_kv_pool = None if pages is None else what

    def kv_pool_on_load(self) -> str:
        """Which KV pool the next worker loads with, for the answers that start one."""
        if self.kept_kv_pool is None:
            return "the KV pool sized as at start"
        return f"the KV pool at the size set live ({self.kept_kv_pool})"

    def _clear_waits(self) -> None:
        self.memory_wait = None
        self.wait_reason = None
        self._waking = False

    def _enter_memory_wait(self, wait: MemoryWait) -> None:
        """The plan does not fit until other processes free memory: wait for it (the
        worker is exiting; :meth:`_exited_unloaded` starts the wait)."""
        self.state = State.WAITING_FOR_MEMORY
        self._waking = False
        self.memory_wait = wait
        self.wait_reason = wait.describe()
        log.warning("waiting for GPU memory: %s", self.wait_reason)
        self._publish_health()

    def _enter_gpu_wait(self, reason: str) -> None:
        delay_s = self._gpu_backoff.next_delay_s()
        self.state = State.WAITING_FOR_GPU
        self._waking = False
        self.wait_reason = reason
        self._restart_at = time.monotonic() + delay_s
        log.warning("waiting for the GPU (next try in %.0f s): %s", delay_s, first_line(reason))
        self._publish_health()

    def _exited_unloaded(self, worker: WorkerProcess, status: ExitStatus) -> None:
        """The worker exited in a waiting, paused or idle state: no crash; what it
        carried ends (or waits for the next worker), and the wait begins."""
        log.info("worker %s %s (%s)", worker.pid, status.describe(), self.state.value)
        self._publish(exited_event(worker.pid, status, self.restarts))
        if self.state in (State.PAUSED, State.IDLE):
            self._inflight.fail_all(
                ENGINE_PAUSED, f"the engine was unloaded ({self.state.value}); retry", retry=False
            )
            if self._resume_pending:
                self._resume_pending = False
                self._start_unloaded(waking=True)
                return
        else:
            self._inflight.fail_all(
                ENGINE_RESTARTED, f"the engine is {self.state.value}; retry the request", retry=True
            )
        if self.state is State.WAITING_FOR_MEMORY:
            self._spawn_task(self._await_memory())
        elif self.state is State.WAITING_FOR_GPU:
            delay_s = max((self._restart_at or 0.0) - time.monotonic(), 0.0)
            self._spawn_task(self._await_gpu(delay_s))
        self._publish_health()

    async def _await_memory(self) -> None:
        wait, source = self.memory_wait, self.vram_source
        if wait is None or source is None:
            return
        sample = await wait_for_memory(
            source, wait, self.config.memory_settle_s, on_change=self._publish_health
        )
        if self.state is not State.WAITING_FOR_MEMORY or self._worker is not None:
            return
        self.last_memory_wait = wait
        if wait.misfit.simulated:
            # A simulated card's figures are the worker's config: plan on the card now.
            self._worker_config = _with_device_free(self._worker_config, sample.free_bytes)
        log.info(
            "%d MiB of GPU memory free for %.0f s: starting the worker",
            sample.free_bytes >> 20,
            self.config.memory_settle_s,
        )
        self._start_unloaded()

    async def _await_gpu(self, delay_s: float) -> None:
        await sleep_or_gpu_appears(self.vram_source, delay_s)
        if self.state is State.WAITING_FOR_GPU and self._worker is None:
            log.info("trying the GPU again")
            self._start_unloaded()

    def _start_unloaded(self, waking: bool = False) -> None:
        """Spawn a worker from a waiting, paused or idle state: ``starting`` when it is
        the first or ``waking`` a paused or idle engine (a load, not a restart after a
        crash), else ``restarting``."""
        self.state = State.STARTING if self._first_start or waking else State.RESTARTING
        self.memory_wait = None
        self.wait_reason = None
        self._waking = waking
        self._spawn_and_publish()


    def _cancel_pending(self) -> None:
        self._restart_at = None
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()  # a pending restart or wait

    async def unload(self, state: State, reason: str) -> None:
        """Stop the worker and give its memory back, entering ``paused`` or ``idle``
        (``state``); ``reason`` is for people (health, events)."""
        assert state in (State.PAUSED, State.IDLE)
        self._cancel_pending()
        self.state = state
        self.memory_wait = None
        self.wait_reason = reason
        self._waking = False
        self._resume_pending = False
        log.info("unloading the engine (%s): %s", state.value, reason)
        self._publish_health()
        worker = self._worker
        if worker is not None:
            # Longer than a shutdown's wait: nothing hurries, and a worker that exits by
            # itself frees its memory as cleanly as a killed one but logs no kill.
            await worker.stop(timeout_s=UNLOAD_TIMEOUT_S)

    async def unload_when_done(
        self,
        reason: str,
        timeout_s: float = UNLOAD_DRAIN_TIMEOUT_S,
        poll_s: float = 0.05,
        waiting: Callable[[], bool] = lambda: False,
        wanted: Callable[[], bool] = lambda: True,
    ) -> bool:
        """Enter ``idle`` as :meth:`unload` does, once the sequences in flight have
        finished and ``waiting()`` (requests admitted, not yet sent) is false (as Ollama's
        unload waits for the generations running), or after ``timeout_s`` seconds (those
        still running then end with 503 ``engine_paused``; ``math.inf``: never).
        Returns False, unloading nothing, when the worker was no longer loaded or loading
        by then (another unload, a pause, a failure), or once ``wanted()`` is false (a
        later request's keep_alive replaced the one that asked)."""
        deadline = time.monotonic() + timeout_s
        while (
            (self._inflight.busy or waiting())
            and self.state in UNLOADABLE
            and time.monotonic() < deadline
            and wanted()
        ):
            await asyncio.sleep(poll_s)
        if self.state not in UNLOADABLE or not wanted():
            return False
        await self.unload(State.IDLE, reason)
        return True

    def unload_once_idle(
        self, reason: str, waiting: Callable[[], bool], wanted: Callable[[], bool] = lambda: True
    ) -> None:
        """In the background, :meth:`unload_when_done` without a deadline: at once when
        nothing runs or waits (``waiting()``: requests admitted, not yet sent), else as
        soon as the last of them has finished, never ending one; dropped once
        ``wanted()`` is false."""
        self._spawn_task(self.unload_when_done(reason, math.inf, waiting=waiting, wanted=wanted))

    async def pause(self) -> str:
        """Game mode: stop the worker and give all its memory back until :meth:`resume`
        (or, with ``load_on_request``, a request)."""
        if self.state is State.PAUSED:
            return "already paused"
        pid = self.worker_pid if self.worker_alive else None
        await self.unload(
            State.PAUSED,
            pause_reason(self.config.load_on_request),
        )
        return f"paused: worker {pid} stopped, its memory given back" if pid else "paused"

    def resume(self, by: str = "the control API") -> str:
        """Load the worker again from ``paused`` or ``idle``; in any other state there is
        nothing to resume (a worker runs, loads or is waited for). The answer names the
        KV pool it loads with (:meth:`kv_pool_on_load`)."""
        if self.state not in (State.PAUSED, State.IDLE):
            return f"nothing to resume: the engine is {self.state.value}"
        log.info("resuming the engine (%s), asked for by %s", self.state.value, by)
        if self._worker is not None:
            # Still stopping (an unload in progress): the next worker starts at its exit.
            self._resume_pending = True
            self._waking = True
            return f"resuming once the worker being unloaded has stopped, with {self.kv_pool_on_load()}"
        self._cancel_pending()
        self._start_unloaded(waking=True)
        return f"resuming: the worker is loading, with {self.kv_pool_on_load()}"

    def unload_idle(self) -> None:
        """Unload the worker for ``keep_alive_s`` without requests (``idle``)."""
        reason = (
            f"unloaded after {self.config.keep_alive_s:g} s without requests (--keep-alive); "
            "the next request loads it again"
        )
        self.state = State.IDLE  # at once: the watchdog asks only once
        self._spawn_task(self.unload(State.IDLE, reason))

    def idle_due(self, now: float) -> bool:
        """Whether a ready worker has been without requests for ``keep_alive_s``."""
        keep = self.config.keep_alive_s
        if keep is None or self.state is not State.READY:
            return False
        if self.link.in_flight or self.requests_waiting():
            self.last_request_at = now  # a request being prepared is no idle time
            return False
        return now - self.last_request_at >= keep


def _with_device_free(config: Any, free_bytes: int) -> Any:
    """``config`` (a WorkerConfig) planning a simulated card with ``free_bytes`` free."""
    engine = config.engine
    free = min(free_bytes, engine.device_total) if engine.device_total is not None else free_bytes
    return msgspec.structs.replace(config, engine=replace(engine, device_free=free))
