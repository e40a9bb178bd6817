"""A long prefill chunk of a host layer with its missing experts staged on the device
(engine.layers.moe.staged_prefill; the ``expert_staged_prefill`` switch), on the CPU
device: the cached experts from their slots, the missing ones through the stage in
waves, the sums equal the all-resident layer's, the counters count a copy per missing
expert, the cache is left as it was, and a short chunk still reads over the bus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from engine.layers.moe import staged_prefill  # noqa: E402
from engine.layers.moe.expert_cache import OffloadedExperts  # noqa: E402
from engine.layers.moe.expert_costs import ALWAYS_COPY  # noqa: E402
from engine.layers.moe.expert_counters import ExpertCounters  # noqa: E402
from engine.layers.moe.expert_stacks import BlockStack  # noqa: E402
from engine.layers.moe.staged_prefill import STAGE_EXPERTS, takes_staging  # noqa: E402
from kernels.moe.quant_reference import fused_moe_quant  # noqa: E402
from kernels.moe.reference import route  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402
from kernels.switches import using  # noqa: E402

TYPES, HIDDEN, INTER, EXPERTS, TOP_K = ("Q4_K", "Q4_K", "Q6_K"), 256, 256, 24, 4


def _stack() -> BlockStack:
    rng = np.random.default_rng(5)
    gate, up, down = (torch.from_numpy(np.stack([random_blocks(t, r, c, rng, scale=1e-3) for _ in range(EXPERTS)]))
                      for t, r, c in ((TYPES[0], INTER, HIDDEN), (TYPES[1], INTER, HIDDEN), (TYPES[2], HIDDEN, INTER)))
    return BlockStack(gate, up, down, TYPES)


def _routed(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, renormalize=True)
    return x, weights, ids


@pytest.fixture
def layer(monkeypatch):
    """An offloaded layer on the CPU device with 3 cached experts, its steps taking the
    bus-read path (the reference kernel reads both tiers)."""
    monkeypatch.setattr(OffloadedExperts, "_reads_over_bus", lambda self, x: x.shape[0] > 0)
    host = _stack()
    store = OffloadedExperts(host, torch.device("cpu"), 3, ExpertCounters(), ALWAYS_COPY)
    for slot, expert in enumerate((2, 7, 11)):
        store.cache.copy_in(slot, host, expert)
        store.slot_of[expert] = slot
    return host, store


def test_a_chunk_is_staged_from_32_routed_rows_an_expert():
    assert takes_staging(2048, 8, 128) and takes_staging(512, 8, 128)
    assert not takes_staging(511, 8, 128) and not takes_staging(128, 8, 128) and not takes_staging(16, 8, 128)


def test_a_staged_chunk_equals_the_resident_layer_and_leaves_the_cache(layer, monkeypatch):
    host, store = layer
    calls = []
    run = staged_prefill.StagedPrefill._run
    monkeypatch.setattr(staged_prefill.StagedPrefill, "_run", lambda self, *a: calls.append(a[-1].clone()) or run(self, *a))
    tokens = 8 * EXPERTS  # 32 routed rows an expert on average
    x, weights, ids = _routed(tokens, seed=1)
    assert takes_staging(tokens, TOP_K, EXPERTS)
    cache_before = [t.clone() for t in store.cache.tensors]
    got = store(x, weights, ids)
    want = fused_moe_quant(x, host.gate, host.up, host.down, TYPES, weights, ids)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    routed = set(torch.unique(ids).tolist())
    missing = sorted(routed - {2, 7, 11})
    # One call over the cached slots, then one a wave of at most STAGE_EXPERTS missing
    # experts, the halves of the stage alternating; every other expert skipped.
    waves = -(-len(missing) // STAGE_EXPERTS)
    assert len(calls) == 1 + waves and waves >= 2
    assert {e: int(calls[0][e]) for e in (2, 7, 11)} == {2: 0, 7: 1, 11: 2}
    assert int((calls[0] >= 0).sum()) == 3
    for i, lut in enumerate(calls[1:]):
        wave = missing[i * STAGE_EXPERTS:(i + 1) * STAGE_EXPERTS]
        assert [int(lut[e]) for e in wave] == [j + (i % 2) * STAGE_EXPERTS for j in range(len(wave))]
        assert int((lut >= 0).sum()) == len(wave)
    c = store.counters
    assert (c.hits, c.misses, c.copies, c.streamed) == (len(routed & {2, 7, 11}), len(missing), len(missing),
                                                        len(missing))
    assert c.misses == c.cpu_runs + c.bus_reads + c.copies
    assert dict(store.slot_of) == {2: 0, 7: 1, 11: 2}
    assert all(torch.equal(a, b) for a, b in zip(store.cache.tensors, cache_before, strict=True))


def test_a_short_chunk_and_the_switch_off_read_over_the_bus(layer, monkeypatch):
    host, store = layer
    monkeypatch.setattr(staged_prefill.StagedPrefill, "forward", lambda *a, **k: pytest.fail("staged"))
    for tokens, on in ((17, True), (8 * EXPERTS, False)):  # a prefill chunk below the rows; the switch off
        x, weights, ids = _routed(tokens, seed=tokens)
        with using(expert_staged_prefill=on):
            got = store(x, weights, ids)
        want = fused_moe_quant(x, host.gate, host.up, host.down, TYPES, weights, ids)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
