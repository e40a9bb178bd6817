"""The control actions of ``/api/control/*`` carried out on the supervisor.

:class:`SupervisorControl` implements :class:`service.control.routes.ControlTarget`: the
router checks the token and the Origin and parses the bodies; this turns each action
into what the supervisor (and its VRAM watcher) does. A change of the KV pool or the
prefix cache is a command to the worker
(:meth:`service.supervision.link.WorkerLink.run_command`); the engine's
``Replanned`` answer becomes a ``replan`` event named ``set_kv_cache``,
``set_expert_cache`` or ``clear_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from engine.memory.kv_fit import pages_in_bytes, usable_pages
from engine.memory.plan import fmt_bytes
from engine.wire import ipc
from engine.wire.messages import BY_CONTROL
from service.common.engine_states import (
    ENGINE_FAILED,
    ENGINE_PAUSED,
    RESTART_HINT,
    RESUME_HINT,
    State,
)
from service.common.errors import APIError, invalid
from service.supervision.supervisor import Supervisor
from service.vram.host_room import check_host_grow
from service.vram.replan import NewExpertCache, NewPoolSize
from service.vram.room import card_room, check_pool_grow, check_split_move, fitting_pages
from service.vram.split_rung import NewSplit
from service.vram.unseen import grown_bytes
from service.vram.watcher import VramWatcher

log = logging.getLogger("headroom.control")

# The reason (for people) of a replan asked for through the control API (the service's
# own replans say which water mark was crossed); its ``origin`` is ``BY_CONTROL``, and
# ``replan`` events name those ``set_kv_cache`` and ``clear_prefix_cache``.
CONTROL_REASON = "asked for through the control API"

# Said with a worker's exit that the control API asked for (log line, ``worker`` event,
# the errors of requests in flight), so it does not read as a crash.
RESTART_REASON = "restart requested by the control API"

# Seconds a restart waits for the killed worker's exit to be taken (a SIGKILL: at once).
RESTART_EXIT_WAIT_S = 15.0


def one_at_a_time(action: Callable[..., Any]) -> Callable[..., Any]:
    """Run a control action only once the ones before it have answered (in the order
    they came): each acts on, and answers about, the state the earlier ones left, so a
    restart and a pause sent together end as one after the other would (a restart after
    the pause: 409 ``engine_paused``; a pause after the restart: the restarting engine
    paused)."""

    @functools.wraps(action)
    async def run(self: SupervisorControl, *args: Any) -> Any:
        async with self.turn:
            result = action(self, *args)
            return await result if inspect.isawaitable(result) else result

    return run


class SupervisorControl:
    """The control actions on one supervisor.

    The actions run one at a time (:func:`one_at_a_time`, :attr:`turn`).

    Args:
        supervisor: the service's supervisor.
        watcher: its VRAM watcher (the reserve, and the KV pool ceiling grows stop at);
            None: those actions answer 501.
        command_timeout_s: how long a command waits for the worker's answer while the
            worker makes no progress (a resize that moves on is waited for to its end:
            :meth:`service.supervision.link.WorkerLink.run_command`); the service passes
            its stall timeout (``--stall-timeout-s``), after which the watchdog kills a
            worker that stopped moving anyway.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        watcher: VramWatcher | None = None,
        *,
        command_timeout_s: float = 30.0,
    ) -> None:
        self.supervisor = supervisor
        self.watcher = watcher
        self.command_timeout_s = command_timeout_s
        self.turn = asyncio.Lock()

    @one_at_a_time
    async def restart(self) -> str:
        """Kill the worker (if any) and start a new one, also from ``failed``; answers
        once the killed worker's exit is taken (state ``restarting``), so an action after
        it sees the restart.

        Raises:
            APIError: 409 while the service is shutting down; 409 ``engine_paused``
                on a paused engine, naming the resume that loads it (the pause is the
                user's choice: a restart does not end it, as a resume does not end
                ``failed``).
        """
        sup = self.supervisor
        if sup.state is State.STOPPED:
            raise APIError(409, "the service is shutting down", code="stopping")
        if sup.state is State.PAUSED:
            raise APIError(409, f"the engine is paused, a restart does not load it: {RESUME_HINT}",
                           code=ENGINE_PAUSED)
        pid = sup.worker_pid if sup.worker_alive else None
        log.info("%s (worker pid %s)", RESTART_REASON, pid)
        killed = sup.worker if sup.worker_alive else None
        sup.restart(reason=RESTART_REASON)
        deadline = time.monotonic() + RESTART_EXIT_WAIT_S
        while killed is not None and sup.worker is killed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        what = f"restarting the worker (pid {pid})" if pid else "starting a new worker"
        return f"{what}, with {sup.kv_pool_on_load()}"

    @one_at_a_time
    async def pause(self) -> str:
        """Game mode: stop the worker and give its memory back (state ``paused``).

        Raises:
            APIError: 409 while the service is shutting down; 409 ``engine_failed`` on a
                failed engine, naming the restart (no worker holds memory to give back,
                and a pause would turn ``failed`` into ``paused``, whose resume starts the
                worker a crash loop stopped).
        """
        state = self.supervisor.state
        if state is State.STOPPED:
            raise APIError(409, "the service is shutting down", code="stopping")
        if state is State.FAILED:
            raise APIError(409, f"the engine has failed and holds no memory, there is nothing to pause: {RESTART_HINT}",
                           code=ENGINE_FAILED)
        return await self.supervisor.pause()

    @one_at_a_time
    def resume(self) -> str:
        """Load the worker again after a pause (or an idle unload).

        Raises:
            APIError: 409 while the service is shutting down; 409 ``engine_failed``
                on a failed engine, naming the restart that starts it again (a
                resume does not: a crash loop is for the user to look into first).
        """
        state = self.supervisor.state
        if state is State.STOPPED:
            raise APIError(409, "the service is shutting down", code="stopping")
        if state is State.FAILED:
            raise APIError(409, f"the engine has failed, a resume does not start it: {RESTART_HINT}",
                           code=ENGINE_FAILED)
        return self.supervisor.resume()

    @one_at_a_time
    def set_reserve(self, reserve: int | Literal["auto"]) -> str:
        """Keep ``reserve`` bytes free for the desktop (``"auto"``: the default rule);
        the watcher replans against it from its next sample. Held in memory: a restart
        of the service goes back to ``--reserve``.

        Raises:
            NotImplementedError: no VRAM watcher (501).
            APIError: 409 ``no_card`` on a CPU engine with no simulated card.
        """
        if self.watcher is None:
            raise NotImplementedError("this service has no VRAM watcher")
        if self._cpu_without_card():
            raise APIError(409, "the engine runs on the CPU: GPU memory is watched, not replanned, so a desktop "
                                "reserve changes nothing (it keeps room on the card of an engine on a GPU; "
                                "--device-total simulates one for tests)", code="no_card", param="reserve")
        return self.watcher.set_reserve(reserve)

    @one_at_a_time
    async def set_kv_cache(self, kv_cache_bytes: int | None) -> str:
        """Resize the KV pool to ``kv_cache_bytes`` (whole pages, rounded down), live;
        None goes back to the plan's size. The size is also the ceiling the watcher
        grows back to until it is changed again, and the pool every next worker (a
        resume, a restart) starts with; None gives the start's sizing back to those.

        A grow to a size must fit the card's room now (:mod:`service.vram.room`) and
        the host's available memory, the new pool counted whole
        (:mod:`service.vram.host_room`); back to the plan's size grows as far as fits now
        (the watcher grows the rest when memory returns); a shrink is always taken.
        "The plan's size" is the pool the worker may grow back to: the start's plan's
        pool, or one request of the wanted context where the start's plan lowered it.

        Raises:
            NotReady: no worker is ready (503).
            ValueError: smaller than one request of the minimum context (400).
            NotImplementedError: the engine cannot resize its pool (501).
            APIError: 409 ``no_room`` for a grow past the card's room or the host's
                available memory (naming the most that fits), 409 when the worker
                refused (e.g. out of device memory growing), 503 when it did not answer.
        """
        sup = self.supervisor
        self._check_loaded()
        pool = sup.link.pool
        if pool is None:
            raise NotImplementedError("this engine cannot resize its KV pool while it runs")
        if kv_cache_bytes is None:
            pages = pool.planned_pages
            what = f"the plan's size ({usable_pages(pages)} pages)"
        else:
            pages = pages_in_bytes(kv_cache_bytes, pool.page_bytes, pool.ring)
            if pages < pool.min_pages:
                raise ValueError(
                    f"a KV cache of {fmt_bytes(kv_cache_bytes)} holds {usable_pages(pages)} pages; the "
                    f"smallest is {usable_pages(pool.min_pages)} pages "
                    f"({fmt_bytes(usable_pages(pool.min_pages) * pool.page_bytes)}): one request of "
                    "the minimum context"
                )
            what = f"{fmt_bytes(kv_cache_bytes)} ({usable_pages(pages)} pages)"
        if self.watcher is None:
            self._check_host_room(pages, pool)
            done = await self._resize(pages, what)
        else:
            async with self.watcher.lock:  # not in the middle of one of the watcher's
                now, room = sup.link.pool or pool, card_room(self.watcher)
                if kv_cache_bytes is None:
                    fits = fitting_pages(room, now, pages)
                    if fits < pages:
                        what += f", of which {usable_pages(fits)} fit the card now"
                    pages = fits
                # What the host cannot hold is refused first (400): no card helps it.
                self._check_host_room(pages, now)
                if kv_cache_bytes is not None:
                    check_pool_grow(room, now, pages)
                self.watcher.kv_ceiling_pages = None if kv_cache_bytes is None else pages
                done = await self._resize(pages, what)
                if done is not None and done.ok:
                    self.watcher.grew(grown_bytes(NewPoolSize(pages, now.pages, what), now))
        answer = self._answer(done)
        self._keep_kv_pool(kv_cache_bytes is not None)
        return answer

    def _keep_kv_pool(self, live: bool) -> None:
        """The next worker starts with the pool a live size left (``live``), or as at
        start (back to the plan's size): :meth:`Supervisor.keep_kv_pool`."""
        sup, pool = self.supervisor, self.supervisor.link.pool
        if not live or pool is None:
            sup.keep_kv_pool(None)
            return
        usable = usable_pages(pool.pages)
        sup.keep_kv_pool(pool.pages, f"{usable} pages, {fmt_bytes(usable * pool.page_bytes)}")

    @one_at_a_time
    async def set_expert_cache(self, expert_cache_bytes: int | None) -> str:
        """Resize the GPU expert cache (routed experts in host memory, ``--cpu-experts``)
        to ``expert_cache_bytes`` (whole slots, rounded down; at most every offloaded
        expert; 0 empties it), live; None goes back to the plan's size. The size is also
        the ceiling the watcher grows the cache back to until it is changed again.

        Raises:
            NotReady: no worker is ready (503).
            NotImplementedError: every expert is on the device: no expert cache (501).
            APIError: 409 ``no_experts`` (``param: "expert_cache"``) for a model with no
                mixture-of-experts layers; as :meth:`set_kv_cache`.
        """
        sup = self.supervisor
        self._check_loaded()
        pool = sup.link.pool
        if pool is not None and pool.moe_layers == 0 and pool.max_expert_slots == 0:
            raise APIError(409, "this model has no mixture-of-experts layers: it has no expert cache to size "
                                "(expert_cache applies to a MoE model whose experts live in host memory, "
                                "--cpu-experts)", code="no_experts", param="expert_cache")
        if pool is None or pool.max_expert_slots == 0 or pool.expert_slot_bytes <= 0:
            raise NotImplementedError(
                "this engine has no expert cache: every routed expert is on the device "
                "(start with --cpu-experts to keep some in host memory)"
            )
        if expert_cache_bytes is None:
            slots = pool.planned_expert_slots
            what = f"the plan's size ({slots} slots)"
        else:
            slots = min(expert_cache_bytes // pool.expert_slot_bytes, pool.max_expert_slots)
            what = f"{fmt_bytes(slots * pool.expert_slot_bytes)} ({slots} slots of {fmt_bytes(pool.expert_slot_bytes)})"
        fields = {"num_slots": slots, "reason": f"{CONTROL_REASON}: expert cache {what}"}
        if self.watcher is None:
            done = await self._command(ipc.ResizeExpertCache, fields)
        else:
            async with self.watcher.lock:
                now = sup.link.pool or pool
                self.watcher.expert_ceiling_slots = None if expert_cache_bytes is None else slots
                done = await self._command(ipc.ResizeExpertCache, fields)
                if done is not None and done.ok:
                    self.watcher.grew(grown_bytes(NewExpertCache(slots, now.expert_slots, what), now))
        return self._answer(done)

    @one_at_a_time
    async def set_cpu_layers(self, cpu_layers: int | None) -> str:
        """Run the last ``cpu_layers`` decoder layers on the CPU (``--cpu-layers auto``: the
        split moves live, ``Engine.move_split``); None goes back to the start's split. The
        count is also the split the watcher moves layers back to until it is changed again.
        A move back to the device must fit the card's room now (:mod:`service.vram.room`);
        a move to the CPU is always taken.

        On a CPU engine with no simulated card no count applies (409 ``split_fixed``,
        whatever the count). Elsewhere the count is checked first (``0..layers - 1``),
        then whether the split can move: with a fixed ``--cpu-layers N``, asking for the
        start's split (or None) changes nothing and is answered so.

        Raises:
            NotReady: no worker is ready (503).
            APIError: 400 (``param: "cpu_layers"``) for a count outside ``0..max``; 409
                ``split_fixed`` for another count under a fixed ``--cpu-layers N``
                (naming ``--cpu-layers auto``) or on a CPU engine with no simulated
                card (any count); 409 ``no_room`` for a move back past the card's room; as :meth:`set_kv_cache` when the worker refuses.
            NotImplementedError: a model (or setting) whose split cannot move (501).
        """
        sup = self.supervisor
        self._check_loaded()
        if self._cpu_without_card():
            # No count applies (every layer runs on the CPU), so none is checked first.
            raise APIError(
                409, "the engine runs on the CPU: every decoder layer runs there already (a split moves layers "
                "between a GPU and the CPU; --device-total simulates a card for tests)",
                code="split_fixed", param="cpu_layers",
            )
        pool = sup.link.pool
        started = self._started_split()
        most = None if pool is None else pool.max_cpu_layers or (pool.decoder_layers - 1 if pool.decoder_layers else None)
        if cpu_layers is not None and not 0 <= cpu_layers <= (most if most is not None else cpu_layers):
            span = f"0 to {most} (one decoder layer stays on the device)" if most is not None else "0 or more"
            raise invalid(f"cpu_layers {cpu_layers}: choose {span}", "cpu_layers")
        if pool is None or pool.max_cpu_layers == 0:
            if started is not None and cpu_layers in (None, started):
                return f"nothing to change: the split is the start's ({started} decoder layers on the CPU)"
            if started is not None:
                raise APIError(
                    409,
                    f"the split is fixed at {started} decoder layers on the CPU (--cpu-layers {started}): it moves "
                    "live only when the server is started with --cpu-layers auto",
                    code="split_fixed", param="cpu_layers",
                )
            raise NotImplementedError(
                "this engine's split cannot move: it needs --cpu-layers auto and a dense "
                "Llama/Qwen2/Qwen3-family model on one device"
            )
        layers = pool.planned_cpu_layers if cpu_layers is None else cpu_layers
        fields = {"cpu_layers": layers, "reason": f"{CONTROL_REASON}: {layers} decoder layers on the CPU"}
        if self.watcher is None:
            done = await self._command(ipc.MoveLayers, fields)
        else:
            async with self.watcher.lock:
                now = sup.link.pool or pool
                check_split_move(card_room(self.watcher), now, layers)
                self.watcher.cpu_floor_layers = cpu_layers
                done = await self._command(ipc.MoveLayers, fields)
                if done is not None and done.ok:
                    self.watcher.grew(grown_bytes(NewSplit(layers, now.cpu_layers, fields["reason"]), now))
        return self._answer(done)

    def _cpu_without_card(self) -> bool:
        """Whether the engine runs on the CPU with no simulated card (``--device-total``),
        where a split has nothing to move between."""
        info, config = self.supervisor.info, getattr(self.supervisor, "config", None)
        engine = config.worker.engine if config is not None else None
        simulated = (getattr(engine, "device_total", None) is not None
                     or getattr(self.watcher, "kind", None) == "simulated")
        return info is not None and info.device == "cpu" and not simulated

    def _started_split(self) -> int | None:
        """The fixed ``--cpu-layers N`` the worker was started with; None for ``auto``."""
        config = getattr(self.supervisor, "config", None)
        text = config.worker.engine.cpu_layers if config is not None else "auto"
        return int(text) if text.isdigit() else None

    async def _command(self, kind: type, fields: dict) -> ipc.ControlDone | None:
        return await self.supervisor.link.run_command(
            kind, origin=BY_CONTROL, timeout_s=self.command_timeout_s, **fields
        )

    def _check_host_room(self, pages: int, pool: ipc.PoolStats) -> None:
        """Refuse a grow the host's memory cannot hold
        (:func:`service.vram.host_room.check_host_grow`); nothing before the worker says
        which device it runs on."""
        info = self.supervisor.info
        if info is not None:
            check_host_grow(pool, pages, info.device)

    async def _resize(self, pages: int, what: str) -> ipc.ControlDone | None:
        return await self.supervisor.link.run_command(
            ipc.ResizePool,
            num_pages=pages,
            reason=f"{CONTROL_REASON}: KV cache {what}",
            origin=BY_CONTROL,
            timeout_s=self.command_timeout_s,
        )

    @one_at_a_time
    async def clear_prefix_cache(self) -> str:
        """Free every prefix-cache page no running request holds.

        Raises:
            NotReady: no worker is ready (503).
            APIError: as :meth:`set_kv_cache`.
        """
        self._check_loaded()
        done = await self.supervisor.link.run_command(
            ipc.EvictPrefixCache, reason=CONTROL_REASON, origin=BY_CONTROL, timeout_s=self.command_timeout_s
        )
        return self._answer(done)

    def _check_loaded(self) -> None:
        """A live change needs a loaded engine: 409 where the user unloaded it (``paused``;
        ``idle``, unloaded after ``--keep-alive`` or an Ollama unload), naming what loads it
        (a retry never would), else 503 while it starts or restarts.

        Raises:
            APIError: 409 ``engine_paused`` or ``engine_idle``.
            NotReady: no worker is ready otherwise (503, with Retry-After).
        """
        state = self.supervisor.state
        if state is State.PAUSED:
            raise APIError(409, f"the engine is paused, a live change needs it loaded: {RESUME_HINT}",
                           code=ENGINE_PAUSED)
        if state is State.IDLE:
            raise APIError(409, "the engine is unloaded (idle), a live change needs it loaded: the next "
                                f"request loads it, or {RESUME_HINT}", code="engine_idle")
        self.supervisor.check_ready()

    def _answer(self, done: ipc.ControlDone | None) -> str:
        if done is None:
            raise APIError(
                503,
                "the engine worker did not answer: it exited, or made no progress for "
                f"{self.command_timeout_s:g} s (--stall-timeout-s); try again",
                type="server_error",
                code="engine_unavailable",
                headers={"Retry-After": "2"},
            )
        if not done.ok:
            raise APIError(409, f"the engine refused: {done.message}", code="refused")
        return done.message
