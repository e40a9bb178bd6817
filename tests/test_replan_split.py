"""The split's rung of the replan, torch-free (:mod:`service.vram.split_rung`): with
``--cpu-layers auto`` a dense model's last decoder layers go to the CPU once the KV pool
is at its floor and the device is still short, the fewest that free enough; when the
memory returns they come back before the pool grows, as many as fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from replan_timeline import (
    CHUNK,
    DESKTOP,
    MIN_PAGES,
    PAGE,
    PLANNED,
    WEIGHTS,
    EngineModel,
    run_timeline,
)

from engine.memory.plan import GiB, MiB
from service.vram.replan import NewChunkCap, NewPoolSize, PoolState, Squeeze
from service.vram.split_rung import NewSplit, give_back, layer_share, take_back

LAYERS = 32
LAYER = WEIGHTS // LAYERS  # 128 MiB a layer


@dataclass
class SplitEngineModel(EngineModel):
    """:class:`EngineModel` of a dense model of :data:`LAYERS` layers whose last ``cpu``
    run on the CPU: their weights and their share of every page leave the device."""

    cpu: int = 0
    max_cpu: int = LAYERS - 1

    def ours(self) -> int:
        return super().ours() - self.cpu * LAYER - self.pages * (PAGE - self.page_bytes())

    def page_bytes(self) -> int:
        return PAGE * (LAYERS - self.cpu) // LAYERS

    def state(self) -> PoolState:
        return dataclasses.replace(
            super().state(), page_bytes=self.page_bytes(), cpu_layers=self.cpu, planned_cpu_layers=0,
            max_cpu_layers=self.max_cpu, layer_bytes=LAYER, device_layers=LAYERS - self.cpu,
        )

    def apply(self, actions) -> None:
        super().apply(actions)
        for move in (a for a in actions if isinstance(a, NewSplit)):
            assert move.before == self.cpu, (move, self.cpu)
            self.cpu = move.cpu_layers


def _game(extra: int):
    """Another process takes the pool's planned bytes above its floor, and ``extra``
    more, from 10 s to 40 s."""
    taken = (PLANNED - MIN_PAGES) * PAGE + extra
    return lambda t: DESKTOP + (taken if 10 <= t < 40 else 0)


def test_layers_move_to_the_cpu_only_at_the_pool_floor_and_come_back_before_it_grows():
    """A game wants 1 GiB beyond the pool's floor: the chunk cap and the pool go first,
    then the fewest layers that free the rest; no squeeze. The game gone, after the hold,
    the layers come back before the pool grows, then the chunk cap: the plan is whole."""
    ctl, model, trace = run_timeline(_game(GiB), seconds=80, model=SplitEngineModel())
    pages, cpu, seen = PLANNED, 0, []
    for d in ctl.decisions:
        for a in d.actions:
            if isinstance(a, NewPoolSize):
                assert not a.grows or cpu == 0, "the pool grew while layers were on the CPU"
                pages = a.num_pages
            elif isinstance(a, NewSplit):
                assert a.grows or pages == MIN_PAGES, "layers moved before the pool was at its floor"
                cpu = a.cpu_layers
                seen.append(("split+" if a.grows else "split-", a.before, a.cpu_layers))
            elif isinstance(a, NewChunkCap) and a.tokens > a.before:
                assert cpu == 0 and pages == PLANNED
    downs = [s for s in seen if s[0] == "split-"]
    assert downs and seen[-1][0] == "split+" and seen[-1][2] == 0, seen
    # The 1 GiB less what the chunk cap gave (448 MiB), to the band's middle: a few of
    # 128 MiB, moved in one go (the pinned card's doubled probe moves pages, not layers).
    assert len(downs) == 1 and 3 <= downs[0][2] <= 8, seen
    assert ctl.squeezes == 0
    low = ctl.low_water_bytes
    assert all(h >= low for t, h, *_ in trace if 12 <= t < 40), "the device stayed short during the game"
    assert (model.cpu, model.pages, model.chunk) == (0, PLANNED, CHUNK), "the plan is whole again"


def test_a_fixed_split_or_a_model_that_cannot_split_squeezes_instead():
    ctl, model, _ = run_timeline(_game(GiB), seconds=30, model=SplitEngineModel(max_cpu=0))
    assert model.cpu == 0 and model.pages == MIN_PAGES
    assert not any(isinstance(a, NewSplit) for d in ctl.decisions for a in d.actions)
    [squeeze] = [a for d in ctl.decisions for a in d.actions if isinstance(a, Squeeze)]
    assert "decoder layers on the CPU" not in squeeze.message


def test_a_demand_beyond_every_layer_moves_all_but_one_and_squeezes():
    ctl, model, _ = run_timeline(_game(8 * GiB), seconds=30, model=SplitEngineModel())
    assert model.cpu == LAYERS - 1 and ctl.squeezes == 1
    [squeeze] = [a for d in ctl.decisions for a in d.actions if isinstance(a, Squeeze)]
    assert f"{LAYERS - 1} decoder layers on the CPU" in squeeze.message


def _state(**kw) -> PoolState:
    return dataclasses.replace(SplitEngineModel(pages=MIN_PAGES).state(), **kw)


def test_the_fewest_layers_that_free_the_shortfall():
    pool = _state()
    share = layer_share(pool, MIN_PAGES)
    assert share == LAYER + MIN_PAGES * PAGE // LAYERS
    for short, k in [(1, 1), (share, 1), (share + 1, 2), (5 * share - MiB, 5)]:
        move, freed = give_back(pool, short, MIN_PAGES, "why")
        assert (move.cpu_layers, move.before, freed) == (k, 0, k * share) and math.ceil(short / share) == k
    assert give_back(pool, share, MIN_PAGES + 1, "why") == (None, 0), "the pool is not at its floor yet"
    assert give_back(pool, 0, MIN_PAGES, "why") == (None, 0)
    assert give_back(_state(cpu_layers=LAYERS - 1), share, MIN_PAGES, "why") == (None, 0), "one stays"


def test_layers_come_back_as_many_as_fit_never_past_the_start():
    pool = _state(cpu_layers=6, planned_cpu_layers=2, device_layers=LAYERS - 6,
                  page_bytes=PAGE * (LAYERS - 6) // LAYERS)
    share = layer_share(pool, MIN_PAGES)
    assert take_back(pool, share - 1, "why") == (None, 0)
    move, cost = take_back(pool, 3 * share + 1, "why")
    assert (move.cpu_layers, cost) == (3, 3 * share) and move.grows
    move, _ = take_back(pool, 100 * share, "why")
    assert move.cpu_layers == 2, "back to the start's split, no further"
    assert take_back(dataclasses.replace(pool, cpu_layers=2), 100 * share, "why") == (None, 0)


def test_the_control_api_sets_the_split_and_the_split_layers_come_back_to():
    """A person asks for a split through the control API: the worker gets the command
    (origin control), and the watcher moves layers back only down to it until asked
    again (null: the start's split). A split that cannot move is a 501's error naming
    --cpu-layers auto; a count out of range a 400's naming the range."""
    import asyncio

    import msgspec
    import pytest
    from pool_fakes import pool_stats
    from test_vram_watcher import FakeSupervisor

    from engine.wire.messages import BY_CONTROL
    from service.common.errors import APIError
    from service.control.actions import SupervisorControl
    from service.vram.watcher import VramWatcher

    pool = msgspec.structs.replace(
        pool_stats(201, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048),
        cpu_layers=0, planned_cpu_layers=0, max_cpu_layers=29, layer_bytes=3 * MiB, device_layers=30,
    )
    sup = FakeSupervisor(pool)
    sup.check_ready = lambda: None  # type: ignore[attr-defined]
    watcher = VramWatcher(sup, None, None, kind="simulated")  # type: ignore[arg-type]
    control = SupervisorControl(sup, watcher)  # type: ignore[arg-type]
    asyncio.run(control.set_cpu_layers(12))
    kind, fields = sup.link.commands[-1]
    assert kind == "MoveLayers" and fields["cpu_layers"] == 12 and fields["origin"] == BY_CONTROL
    moved = msgspec.structs.replace(pool, cpu_layers=12, device_layers=18)
    assert watcher.cpu_floor_layers == 12 and watcher.pool_state(moved).planned_cpu_layers == 12
    asyncio.run(control.set_cpu_layers(None))  # the start's split again
    assert sup.link.commands[-1][1]["cpu_layers"] == 0 and watcher.pool_state(moved).planned_cpu_layers == 0
    with pytest.raises(APIError, match="cpu_layers 30: choose 0 to 29") as refused:
        asyncio.run(control.set_cpu_layers(30))
    assert refused.value.status == 400 and refused.value.param == "cpu_layers"
    sup.link.pool = msgspec.structs.replace(pool, max_cpu_layers=0)
    with pytest.raises(NotImplementedError, match="--cpu-layers auto"):
        asyncio.run(control.set_cpu_layers(3))
