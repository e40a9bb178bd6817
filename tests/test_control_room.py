"""The control API against a simulated card that is almost full, without an engine
(:mod:`service.vram.room`): a grow of the KV pool or a move of layers back to the
device that the card's headroom cannot hold now is refused (409) naming the shortfall
and the most that fits, a shrink or a move to the CPU is always taken; a reserve as
large as the card is a 400; a fixed ``--cpu-layers N`` checks the count first (400),
then refuses a move (409) and takes its own split as a no-op.
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import msgspec
import pytest
from pool_fakes import pool_stats
from test_vram_watcher import FakeSupervisor

from engine.common.units import GiB, MiB
from engine.memory.host import host_memory
from engine.memory.host_room import host_room
from engine.wire import ipc
from service.common.errors import APIError
from service.control.actions import SupervisorControl
from service.vram.room import card_room
from service.vram.simulated import SimulatedSource, simulated_ours_bytes
from service.vram.watcher import VramWatcher

CARD = 2 * GiB


def _control(pool: ipc.PoolStats, free: int, cpu_layers: str = "auto"):
    """A control over a ready worker's ``pool`` whose watcher's last sample shows ``free``
    bytes free on a simulated 2 GiB card (no reserve), the worker started with
    ``--cpu-layers cpu_layers``."""
    sup = FakeSupervisor(pool)
    sup.check_ready = lambda: None  # type: ignore[attr-defined]
    sup.config = SimpleNamespace(worker=SimpleNamespace(engine=SimpleNamespace(cpu_layers=cpu_layers)))  # type: ignore[attr-defined]
    others = CARD - simulated_ours_bytes(pool) - free
    source = SimulatedSource(CARD, [(0.0, others)], ours_bytes=lambda: simulated_ours_bytes(sup.link.pool),
                             clock=lambda: 0.0)
    watcher = VramWatcher(sup, None, source, kind="simulated", reserve=0)  # type: ignore[arg-type]
    watcher.latest = source.sample()
    return sup, watcher, SupervisorControl(sup, watcher)  # type: ignore[arg-type]


def _most_pages(message: str) -> int:
    found = re.search(r"the most that fits now is [\d.]+ \w+ \((\d+) pages\)", message)
    assert found, message
    return int(found.group(1))


def test_a_kv_grow_past_the_cards_headroom_is_refused_naming_the_most_that_fits():
    pool = pool_stats(201, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048)
    sup, watcher, control = _control(pool, free=300 * MiB)
    with pytest.raises(APIError) as refused:
        asyncio.run(control.set_kv_cache(5 * GiB))
    err = refused.value
    assert err.status == 409 and err.code == "no_room" and err.param == "kv_cache"
    assert "short by" in err.message and "free 300 MiB" in err.message, err.message
    assert sup.link.commands == []  # the worker never saw it
    most = _most_pages(err.message)
    # The most that fits leaves the headroom at the floor the watcher's own grows keep.
    room = card_room(watcher)
    assert room is not None and most == 200 + room.room_bytes // MiB and 0 < room.room_bytes < 300 * MiB
    asyncio.run(control.set_kv_cache(most * MiB))  # exactly that fits
    assert sup.link.commands[-1][1]["num_pages"] == most + 1
    watcher.latest = watcher.source.sample()  # the next sample shows the pool grown
    with pytest.raises(APIError, match="no_room|short by"):
        asyncio.run(control.set_kv_cache((most + 1) * MiB))
    asyncio.run(control.set_kv_cache(64 * MiB))  # asking for less is always taken
    assert sup.link.commands[-1][1]["num_pages"] == 65


def test_back_to_the_plans_pool_grows_only_as_far_as_the_card_holds_now():
    """Null is not a size asked for: where the plan's ceiling (here one request of the
    wanted context, 513 pages, where the start's plan had 200) does not fit, the pool
    grows as far as fits and the watcher grows the rest when memory returns."""
    pool = msgspec.structs.replace(
        pool_stats(513, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048), pages=129)
    sup, watcher, control = _control(pool, free=107 * MiB)  # below the watcher's grow floor
    message = asyncio.run(control.set_kv_cache(None))
    assert sup.link.commands[-1][1]["num_pages"] == 129, "no page more fits"
    assert "of which 128 fit the card now" in sup.link.commands[-1][1]["reason"], message
    assert watcher.kv_ceiling_pages is None  # the watcher grows the rest to the plan's ceiling
    _, watcher, control = _control(pool, free=300 * MiB)
    room = card_room(watcher)
    asyncio.run(control.set_kv_cache(None))
    assert control.supervisor.link.commands[-1][1]["num_pages"] == 129 + room.room_bytes // MiB < 513


def _split_pool(cpu_layers: int) -> ipc.PoolStats:
    """30 layers of 3 MiB, the last ``cpu_layers`` on the CPU; pages of 1 MiB over the
    device's layers."""
    return msgspec.structs.replace(
        pool_stats(201, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048),
        cpu_layers=cpu_layers, planned_cpu_layers=0, max_cpu_layers=29, layer_bytes=3 * MiB,
        device_layers=30 - cpu_layers, decoder_layers=30,
    )


def test_a_move_back_to_the_device_past_the_headroom_is_refused_and_a_move_down_taken():
    pool = _split_pool(29)  # a layer takes 3 MiB of weights and 200 MiB of keys and values
    sup, _, control = _control(pool, free=400 * MiB)
    with pytest.raises(APIError) as refused:
        asyncio.run(control.set_cpu_layers(0))
    err = refused.value
    assert err.status == 409 and err.code == "no_room" and err.param == "cpu_layers", err.message
    fewest = int(re.search(r"the fewest that fit now is cpu_layers (\d+)", err.message).group(1))
    assert 0 < fewest < 29 and sup.link.commands == []
    asyncio.run(control.set_cpu_layers(fewest))
    assert sup.link.commands[-1][1]["cpu_layers"] == fewest
    _, _, control = _control(_split_pool(5), free=0)
    asyncio.run(control.set_cpu_layers(29))  # more on the CPU: nothing taken from the card
    with pytest.raises(APIError, match="not one layer fits now"):
        asyncio.run(control.set_cpu_layers(4))


def test_the_host_check_of_a_kv_grow_counts_the_host_pool_of_a_split():
    """29 of 30 layers on the CPU: a page holds 29 layers' keys and values in host
    memory for the one on the device, and the new host pool, counted whole, must fit the
    host's available memory (checked before the card's room)."""
    _, _, control = _control(_split_pool(29), free=700 * MiB)
    total, room = host_memory()[0], host_room().pool_bytes  # available less the margin start's check keeps
    asked = (room // (29 * MiB) + 8) * MiB  # past the host by 8 pages of its pool, within the card
    with pytest.raises(APIError, match="host pool of 29 layers on the CPU, 29 MiB a page") as refused:
        asyncio.run(control.set_kv_cache(asked))
    assert refused.value.status == 409 and refused.value.code == "no_room" and refused.value.param == "kv_cache"
    found = re.search(r"the most it can grow to now is [\d.]+ \w+ \((\d+) pages\)", refused.value.message)
    assert found, refused.value.message
    most = int(found.group(1))
    assert room // (29 * MiB) - 8 <= most + 1 <= room // (29 * MiB) and (most + 1) * 29 * MiB <= total


def test_a_reserve_as_large_as_the_card_is_refused_naming_its_size():
    pool = pool_stats(201, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048)
    _, watcher, control = _control(pool, free=300 * MiB)
    with pytest.raises(ValueError, match=r"it has 2\.00 GiB in all"):
        asyncio.run(control.set_reserve(100 * GiB))
    with pytest.raises(ValueError, match="choose less"):
        asyncio.run(control.set_reserve(CARD))
    assert watcher.reserve == 0  # unchanged
    assert "1.00 GiB" in asyncio.run(control.set_reserve(GiB)) and watcher.reserve == GiB


def test_a_fixed_split_checks_the_count_then_refuses_a_move_and_takes_its_own_split():
    pool = msgspec.structs.replace(
        pool_stats(201, min_pages=33, activation_bytes_per_token=0, max_context_tokens=2048), decoder_layers=30)
    sup, _, control = _control(pool, free=300 * MiB, cpu_layers="3")
    for bad in (-1, 100, 30):
        with pytest.raises(APIError) as refused:
            asyncio.run(control.set_cpu_layers(bad))
        err = refused.value
        assert err.status == 400 and err.param == "cpu_layers" and "choose 0 to 29" in err.message
    with pytest.raises(APIError) as refused:
        asyncio.run(control.set_cpu_layers(5))
    assert refused.value.status == 409 and "--cpu-layers auto" in refused.value.message
    for same in (None, 3):
        assert "nothing to change" in asyncio.run(control.set_cpu_layers(same))
    assert sup.link.commands == []
