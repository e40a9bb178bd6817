"""Routed experts in a host tier with a cache tier in front (engine.layers.moe.expert_cache),
checked on the CPU: the host tier is one CPU tensor, the cache another, and the copy,
CPU-run and eviction choices are the ones a GPU would make. Greedy decoding through a
paged KV pool must give the all-resident model's ids, whatever the cache holds."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from model_checks import engine_greedy, halved_cache_run, paged_greedy, two_prompts

from engine.layers.moe.expert_cache import OffloadedExperts
from engine.layers.moe.expert_costs import ALWAYS_COPY, ALWAYS_CPU, CostModel, measure_costs
from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.expert_stacks import DenseStack
from engine.layers.moe.offload import offload_experts
from engine.loader.load import load_model

VOCAB = 256
STEPS = 32


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny(request, tmp_path_factory, make_tiny_hf_model):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_hf_model(request.param, path, vocab_size=VOCAB)
    model, config = load_model(path, "cpu", torch.float32)
    return model, config


def _prompts() -> dict[str, list[int]]:
    return two_prompts(VOCAB, 0)


@pytest.fixture(scope="module")
def reference(tiny, paged_runner):
    model, config = tiny
    return paged_greedy(paged_runner(model, config), _prompts(), STEPS)[0]


# Mixed: a copy pays off from 2 tokens on, so decode rows of one token run on the CPU.
MIXED = CostModel(copy_bytes_per_s=1.0, expert_bytes=2, cpu_s_base=0.0, cpu_s_per_token=1.0)


@pytest.mark.parametrize(("costs", "slots"), [(ALWAYS_COPY, 3), (ALWAYS_CPU, 2), (MIXED, 2), (ALWAYS_COPY, 1)],
                         ids=["copy-lru", "cpu", "mixed", "one-slot"])
def test_greedy_ids_equal_the_all_resident_model(tiny, paged_runner, reference, costs, slots):
    model, config = tiny
    hybrid = copy.deepcopy(model)
    stores, counters = offload_experts(hybrid, config.moe_layers, slots, costs)
    got, _ = paged_greedy(paged_runner(hybrid, config), _prompts(), STEPS)
    assert got == reference
    assert counters.hits + counters.misses > 0
    if costs is ALWAYS_CPU:
        assert counters.copies == 0 and counters.cpu_runs == counters.misses
    if costs is ALWAYS_COPY:
        # A miss runs on the CPU only when every slot holds an expert of the same step.
        assert counters.copies > 0 and counters.copies + counters.cpu_runs == counters.misses
        if slots > 1:  # one slot may hold an expert every step needs
            assert (counters.evictions > 0) == (slots < config.num_experts)
    if costs is ALWAYS_COPY and slots < config.num_experts_per_tok:
        # No slot may be evicted for an expert of the same step: the rest stream through.
        assert counters.streamed > 0 and counters.cpu_runs == 0
    if costs is MIXED:
        assert counters.copies > 0 and counters.cpu_runs > 0
    # The experts' device memory is the cache's now: the host tier holds every expert.
    for s in stores:
        assert s.num_slots == slots and s.host.num_experts == config.num_experts


def test_a_cache_halved_mid_run_and_grown_back_keeps_outputs_equal(tiny, paged_runner, reference):
    model, config = tiny
    hybrid = copy.deepcopy(model)
    assert halved_cache_run(paged_runner(hybrid, config), _prompts(), STEPS, hybrid, config)[0] == reference


def _store(num_experts=4, slots=2, costs=ALWAYS_COPY) -> OffloadedExperts:
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(num_experts, 6, 4, generator=gen)
    dn = torch.randn(num_experts, 4, 3, generator=gen)
    return OffloadedExperts(DenseStack(gu, dn), torch.device("cpu"), slots, ExpertCounters(), costs)


def _route(store: OffloadedExperts, *experts: int) -> None:
    ids = torch.tensor([[e] for e in experts])
    store(torch.randn(len(experts), 4), torch.ones(len(experts), 1), ids)


def test_lru_evicts_the_least_recently_used_expert():
    store = _store()
    _route(store, 0)
    _route(store, 1)
    _route(store, 0)  # 0 is now the most recent
    _route(store, 2)  # evicts 1
    assert set(store.slot_of) == {0, 2}
    assert store.counters.evictions == 1
    assert (store.counters.hits, store.counters.misses, store.counters.copies) == (1, 3, 3)
    assert store.counters.hit_rate == pytest.approx(1 / 4)
    # The cached slot holds that expert's weights.
    assert torch.equal(store.cache.gate_up[store.slot_of[2]], store.host.gate_up[2])


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_step_routing_past_the_cache_streams_the_rest_through_its_slots(slots):
    """Six experts in one step, fewer slots: the cached ones run, the rest pass through
    the slots in waves (none on the CPU: a copy is cheaper), the output equals the
    all-resident layer's exactly, and the cache keeps what the last waves left."""
    from kernels.dispatch import fused_moe

    store = _store(num_experts=8, slots=slots)
    _route(store, 7)  # one expert cached before the big step
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, generator=gen)
    ids = torch.tensor([[e, (e + 1) % 6] for e in range(6)] * 2)
    ids[0, 1] = 7
    w = torch.rand(12, 2, generator=gen)
    before = dataclasses.replace(store.counters)
    got = store(x, w, ids)
    assert torch.equal(got, fused_moe(x, store.host.gate_up, store.host.down, w, ids))
    c = dataclasses.replace(store.counters)
    assert c.cpu_runs == before.cpu_runs and c.hits == before.hits + 1
    assert c.streamed - before.streamed == 6 - max(slots - 1, 0)  # 7 stays cached, free slots filled first
    assert c.copies - before.copies == 6 and c.misses - before.misses == 6
    assert len(store.slot_of) == slots and sorted(store.slot_of.values()) == list(range(slots))
    for e, s in store.slot_of.items():
        assert torch.equal(store.cache.gate_up[s], store.host.gate_up[e])
    # The next step's hits are served from what the waves left.
    assert store(x[:1], w[:1, :1], torch.tensor([[max(store.slot_of)]])).shape == (1, 4)
    assert store.counters.hits == c.hits + 1


def test_shrinking_keeps_the_most_recent_experts_in_their_weights():
    store = _store(slots=3)
    for e in (0, 1, 2):
        _route(store, e)
    store.resize(1)
    assert list(store.slot_of) == [2] and store.num_slots == 1
    assert torch.equal(store.cache.down[store.slot_of[2]], store.host.down[2])
    store.resize(4)
    assert list(store.slot_of) == [2] and store.num_slots == 4
    with pytest.raises(ValueError, match="not in 0..4"):
        store.resize(5)


def test_a_hot_expert_is_copied_in_once_its_reuse_pays_for_the_copy():
    """A copy costs three CPU runs: a cold expert runs on the CPU; one routed to every
    step is credited with the steps it would serve from the cache, and is copied in."""
    store = _store(slots=4, costs=CostModel(copy_bytes_per_s=1.0, expert_bytes=3, cpu_s_base=1.0, cpu_s_per_token=0.0))
    _route(store, 0)
    assert store.counters.cpu_runs == 1 and not store.slot_of
    for _ in range(30):
        _route(store, 0)
    assert 0 in store.slot_of and store.counters.copies == 1 and store.counters.hits > 0


def test_cost_model_copies_when_a_copy_beats_the_cpu_run():
    costs = CostModel(copy_bytes_per_s=100.0, expert_bytes=100, cpu_s_base=0.2, cpu_s_per_token=0.1)
    assert costs.copy_s() == 1.0
    assert not costs.prefers_copy(1) and costs.prefers_copy(8)
    measured = measure_costs(torch.randn(2, 64, 32), torch.randn(2, 32, 32), torch.device("cpu"), repeats=1)
    assert measured.expert_bytes == (64 * 32 + 32 * 32) * 4
    assert measured.copy_bytes_per_s > 0 and measured.cpu_s(256) >= measured.cpu_s(1) >= 0


def test_a_dense_layer_cannot_be_offloaded(tiny):
    model, config = tiny
    dense = [i for i in range(config.num_layers) if i not in config.moe_layers]
    if not dense:
        pytest.skip("every layer is sparse")
    with pytest.raises(ValueError, match="no routed experts"):
        offload_experts(copy.deepcopy(model), (dense[0],), 2, ALWAYS_COPY)


def test_the_engine_loads_a_hybrid_plan_and_decodes_the_same_ids(tiny, tmp_path_factory, make_tiny_hf_model, caplog):
    """--cpu-experts 1 on a simulated 8 GiB card: the last MoE layer's experts go to the
    host tier behind the plan's expert cache, and greedy ids equal --cpu-experts none,
    with the cache halved by a live replan mid-stream."""
    from engine.common.config import EngineConfig

    _, config = tiny
    kind = "mixtral" if config.architecture == "MixtralForCausalLM" else "qwen3_moe"
    path = tmp_path_factory.mktemp(kind + "-engine")
    make_tiny_hf_model(kind, path, vocab_size=VOCAB)

    def halve(engine, step: int) -> None:
        if step == 6:  # a live replan mid-stream, between steps
            slots = engine.stats().expert_cache_slots
            assert engine.resize_expert_cache(slots // 2) == (slots - slots // 2) * engine.expert_stores[0].slot_bytes

    def greedy(cpu_experts: str, on_step=None):
        return engine_greedy(EngineConfig(model=str(path), device="cpu", dtype="float32", device_total=8 << 30,
                                          cpu_experts=cpu_experts, max_running_requests=4), _prompts(), 16, on_step)

    hybrid, got = greedy("1", halve)
    whole, ref = greedy("none")
    assert got == ref
    # Without a planned device there is nothing to split, and the log says the flag did nothing.
    with caplog.at_level(logging.WARNING, logger="headroom.engine"):
        unplanned, _ = engine_greedy(EngineConfig(model=str(path), device="cpu", dtype="float32", cpu_experts="1",
                                                  max_running_requests=4), _prompts(), 2)
    assert unplanned.plan is None and not unplanned.expert_stores
    assert "--cpu-experts 1 has no effect on cpu without a planned device" in caplog.text
    assert hybrid.plan.cpu_expert_layers == 1 and len(hybrid.expert_stores) == 1
    assert hybrid.plan.expert_cache_slots > 0
    assert sum(s.num_slots for s in hybrid.expert_stores) == min(hybrid.plan.expert_cache_slots, config.num_experts) // 2
    stats = hybrid.stats()
    assert stats.expert_cache_hits + stats.expert_cache_misses > 0
    assert stats.expert_cache_slots == sum(s.num_slots for s in hybrid.expert_stores)
    assert stats.expert_cache_misses == stats.expert_copies + stats.expert_cpu_runs + stats.expert_bus_reads
    assert whole.stats().expert_cache_slots == 0
    with pytest.raises(ValueError, match="no routed experts live in host memory"):
        whole.resize_expert_cache(4)
    assert whole.plan.cpu_expert_layers == 0 and not whole.expert_stores


def test_hot_swaps_bring_in_clearly_hotter_experts_only():
    """The bus-read cache's refresh (engine.layers.moe.bus_reads.hot_swaps): free slots
    take the hottest uncached experts; a full cache swaps only for an expert hotter than
    its coldest by the margin, at most SWAPS_PER_REFRESH a refresh; even heat swaps none."""
    from engine.layers.moe.bus_reads import SWAP_MARGIN, SWAPS_PER_REFRESH, hot_swaps

    heat = torch.tensor([0.1, 0.5, 0.0, 0.35, 0.2], dtype=torch.float64)
    assert hot_swaps(heat, {}, 2) == [(1, None), (3, None)]
    assert hot_swaps(heat, {0: 0, 4: 1}, 2) == [(1, 0), (3, 4)]  # 0.5 > 1.5 * 0.1, 0.35 > 1.5 * 0.2
    even = torch.full((8,), 0.25, dtype=torch.float64)
    assert hot_swaps(even, {0: 0, 1: 1}, 2) == []
    assert hot_swaps(torch.tensor([0.1, 0.1 * SWAP_MARGIN], dtype=torch.float64), {0: 0}, 1) == []
    many = torch.arange(32, dtype=torch.float64)
    assert len(hot_swaps(many, {}, 32)) == SWAPS_PER_REFRESH


def test_bus_read_counts_are_read_outside_the_step_that_made_them():
    """The first step (in inference mode) creates the device counts; stats read and zero
    them between steps, outside it: that must work (on the H200 it raised "Inplace update
    to inference tensor outside InferenceMode")."""
    from engine.layers.moe.bus_reads import BusReads, LiveRows

    rows = LiveRows(torch.device("cpu"))
    with torch.inference_mode():
        bus = BusReads(4, torch.device("cpu"))
        bus.count(torch.tensor([[0, 2], [2, 3]]), rows)
        bus.steps += 1  # as OffloadedExperts.after_forward counts a step
    counts, steps = bus.take_counts()
    assert counts.tolist() == [1.0, 0.0, 2.0, 1.0] and steps == 1
    bus.sync_lut({2: 0})
    assert bus.lut.tolist() == [-1, -1, 0, -1] and not bus.stale


def test_a_graphs_padding_rows_heat_no_expert():
    """A CUDA graph replays a batch of 3 at its captured size 4: the padding row (token
    0, always the same experts) is marked dead and adds nothing to the routing counts;
    marking 2 live rows again makes the counts follow."""
    from engine.layers.moe.bus_reads import BusReads, LiveRows

    rows, bus = LiveRows(torch.device("cpu")), BusReads(4, torch.device("cpu"))
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 3]])  # the last row is the padding
    rows.mark(3)
    bus.count(ids, rows)
    assert bus.routed.tolist() == [3.0, 1.0, 1.0, 1.0]
    rows.mark(2)
    bus.count(ids, rows)
    assert bus.routed.tolist() == [5.0, 2.0, 2.0, 1.0]
    rows.mark(100)  # an eager step: every row it has is live
    assert rows.weights.tolist() == [1.0] * len(rows.weights)


def test_more_layers_move_to_host_memory_mid_run_and_the_ids_stay(tmp_path, make_tiny_hf_model):
    """The measured plan's re-placement (engine.core.plan_stages, an auto placement the
    profile run cannot fit; on CUDA in tests/gpu): between steps the experts of two more
    MoE layers join the one in host memory, sharing its counters and live rows, and
    greedy ids equal --cpu-experts none's."""
    from engine.common.config import EngineConfig

    make_tiny_hf_model("qwen3_moe", tmp_path, vocab_size=VOCAB, num_hidden_layers=4)  # MoE: 0, 2, 3

    def greedy(cpu_experts: str, on_step=None):
        return engine_greedy(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", device_total=8 << 30,
                                          cpu_experts=cpu_experts, max_running_requests=4), _prompts(), 16, on_step)

    def more(engine, step: int) -> None:
        if step == 5:
            with pytest.raises(ValueError, match="not more than 1 now and at most 3"):
                engine._offload_more_experts(1)
            engine._offload_more_experts(3)

    moved, got = greedy("1", more)
    _, ref = greedy("none")
    assert got == ref
    stores = moved.expert_stores
    assert [s.layer_index for s in stores] == list(moved.model_config.moe_layers) == [0, 2, 3]
    assert moved.knobs.cpu_experts == "3"
    assert all(s.live_rows is stores[0].live_rows and s.counters is moved.expert_counters for s in stores)
    assert [s.num_slots for s in stores[:2]] == [0, 0]  # the moved layers' slots come from the next plan
    stats = moved.stats()
    assert stats.expert_cache_misses == stats.expert_copies + stats.expert_cpu_runs + stats.expert_bus_reads > 0
