"""A model of the engine's memory on a 16 GiB desktop card and a timeline runner, for the
replan controller's tests (``test_replan.py``, ``test_replan_experts.py``): the
controller decides on simulated watcher samples, the model applies its actions at once,
as the worker would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.memory.plan import GiB, MiB, reserve_for, safety_margin_for
from service.vram.replan import (
    EmptyPrefixCache,
    NewChunkCap,
    NewPoolSize,
    PoolState,
    ReplanController,
    default_water_marks,
)
from service.vram.simulated import SimulatedSource
from service.vram.sources import CardOfLimit, resolve_reserve

TOTAL = 16 * GiB
PAGE = 2 * MiB
WEIGHTS = 4 * GiB
RUNTIME = 512 * MiB
APT = 256 << 10  # activation bytes per token of prefill chunk
CHUNK = 2048
DESKTOP = GiB
RESERVE = reserve_for(TOTAL, True)
MARGIN = safety_margin_for(TOTAL)
PLANNED = (TOTAL - DESKTOP - RESERVE - MARGIN - WEIGHTS - RUNTIME - CHUNK * APT) // PAGE
MIN_PAGES = GiB // PAGE + 1  # one request of the minimum context


@dataclass
class EngineModel:
    """The engine's memory: weights, runtime, the activation peak at the chunk cap, the
    KV pool; applies the controller's actions at once, as the worker would."""

    pages: int = PLANNED
    chunk: int = CHUNK
    cached: int = 40
    planned: int = PLANNED
    free: int = 10

    def ours(self) -> int:
        return WEIGHTS + RUNTIME + self.chunk * APT + self.pages * PAGE

    def state(self) -> PoolState:
        return PoolState(
            pages=self.pages,
            planned_pages=self.planned,
            min_pages=MIN_PAGES,
            page_bytes=PAGE,
            prefill_chunk=self.chunk,
            planned_prefill_chunk=CHUNK,
            activation_bytes_per_token=APT,
            free_pages=self.free,
            cached_pages=self.cached,
        )

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, NewChunkCap):
                assert a.before == self.chunk
                self.chunk = a.tokens
            elif isinstance(a, EmptyPrefixCache):
                self.cached = 0
            elif isinstance(a, NewPoolSize):
                assert a.before == self.pages
                self.pages = a.num_pages


def run_timeline(
    others, *, seconds=100.0, hz=4.0, hold_s=10.0, model=None, display=True, card=TOTAL, limit=None
):
    """Sample ``others(t)`` at ``hz`` for ``seconds`` on a card of ``card`` bytes, read as
    one of ``limit`` bytes when given (``--device-limit``); returns (controller, model,
    trace) with trace rows ``(t, headroom before acting, pages after, chunk after,
    actions)``."""
    model = model or EngineModel()
    src = SimulatedSource(card, others, ours_bytes=model.ours, display_attached=display)
    if limit is not None:
        src = CardOfLimit(src, limit)
    low, high = default_water_marks(TOTAL)
    ctl = ReplanController(low, high, hold_s=hold_s)
    trace = []
    for i in range(int(seconds * hz)):
        t = i / hz
        sample = src.sample(at=t)
        actions = ctl.decide(sample, model.state())
        model.apply(actions)
        trace.append(
            (t, sample.headroom(resolve_reserve(None, sample)), model.pages, model.chunk, actions)
        )
    return ctl, model, trace


def desktop_day(seed: int = 0):
    """A game takes 40% of the card at 20 s, a browser spikes by 1.5 GiB at 40-44 s, both
    leave at 60 s; NVML's numbers wobble by up to 48 MiB at every sample."""
    rng = random.Random(seed)

    def others(t: float) -> int:
        b = DESKTOP
        if 20 <= t < 60:
            b += int(0.4 * TOTAL)
        if 40 <= t < 44:
            b += 3 * GiB // 2
        return b + rng.randint(-48 * MiB, 48 * MiB)

    return others


def pages_at(trace, t):
    return next(row[2] for row in trace if row[0] >= t)


def directions(ctl) -> list[str]:
    """The pool's resizes in order, ``"-"`` for a shrink and ``"+"`` for a grow, runs of
    the same direction merged: every change of sign is a reversal."""
    out: list[str] = []
    for d in ctl.decisions:
        for a in d.actions:
            if isinstance(a, NewPoolSize):
                sign = "+" if a.grows else "-"
                if not out or out[-1] != sign:
                    out.append(sign)
    return out
