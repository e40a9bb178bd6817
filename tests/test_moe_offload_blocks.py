"""Routed experts of a GGUF kept in blocks in both tiers of the expert cache
(engine.layers.moe.expert_cache over a BlockStack), checked on the CPU: the host tier and
the cache tier are uint8 CPU tensors of the file's blocks, a copy moves blocks, a cached
expert runs the quantized product's reference over slot ids, a CPU run dequantizes the
host tier's blocks (torch) or runs them in their blocks (the C kernels). Greedy decoding
through a paged KV pool must give the all-resident quantized model's ids and logits
(QuantExperts, the same reference; the C kernels' logits within their activation
rounding), whatever the cache holds; the memory plan prices the host tier and the cache
in block bytes.

Two files: a Qwen3-MoE with its experts as a Q4_K_M file holds them (gate and up Q4_K,
down Q6_K; one sparse layer of 8 experts, top-2) and a Mixtral in Q8_0 (two sparse
layers of 4 experts, top-2), both float32.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

gguf = pytest.importorskip("gguf")

from model_checks import engine_greedy, halved_cache_run, paged_greedy, two_prompts  # noqa: E402
from test_gguf_convert import VOCAB, write_gguf  # noqa: E402
from test_gguf_moe_quant import EXPERT_TYPES, write_tiny_moe_gguf  # noqa: E402

from engine.layers.moe.expert_cache import OffloadedExperts  # noqa: E402
from engine.layers.moe.expert_costs import ALWAYS_COPY, ALWAYS_CPU, CostModel, measure_stack_costs  # noqa: E402
from engine.layers.moe.expert_counters import ExpertCounters  # noqa: E402
from engine.layers.moe.expert_stacks import BlockStack, stack_of  # noqa: E402
from engine.layers.moe.offload import offload_experts  # noqa: E402
from engine.layers.moe.quant_experts import QuantExperts  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.gguf_quant import gguf_weight_size, load_gguf_quantized  # noqa: E402
from engine.loader.hf_config import load_model_config  # noqa: E402
from kernels.moe.quant_reference import fused_moe_quant  # noqa: E402

STEPS = 32
# A copy pays off from 2 tokens on, so decode rows of one token run on the CPU.
MIXED = CostModel(copy_bytes_per_s=1.0, expert_bytes=2, cpu_s_base=0.0, cpu_s_per_token=1.0)


@pytest.fixture(scope="module", params=["qwen3moe-q4_k_m", "mixtral-q8_0"])
def tiny(request, tmp_path_factory, make_tiny_hf_model):
    """(GGUF path, config, the model with its experts resident in blocks)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3moe-q4_k_m":
        path, config = write_tiny_moe_gguf(folder, make_tiny_hf_model)
    else:
        path = folder / "mixtral.gguf"
        write_gguf(path, "llama", make_tiny_hf_model("mixtral", None, vocab_size=VOCAB))
        config = load_model_config(convert_gguf(path, folder / "hf"))
    model = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    assert all(isinstance(model.model.layers[i].mlp.experts, QuantExperts) for i in config.moe_layers)
    return path, config, model


def _prompts() -> dict[str, list[int]]:
    return two_prompts(VOCAB, 3)


@pytest.fixture(scope="module")
def reference(tiny, paged_runner):
    """The all-resident model's greedy ids and logits, its experts through the quantized
    product's reference (the C kernels switched off, which would run them on the CPU)."""
    from kernels.switches import using

    _, config, model = tiny
    with using(cpu_kernels=False):
        return paged_greedy(paged_runner(model, config), _prompts(), STEPS)


def _same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 summation order: the module's reference may have run with another
    torch thread count (the suite fits threads to the free cores), which regroups sums."""
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def _offloaded_run(tiny, paged_runner, reference, costs, slots):
    """The model with every MoE layer's experts offloaded (``slots`` a layer, CPU runs
    through torch: the C kernels' are checked below), decoded: its greedy ids and logits
    equal the all-resident model's (the same reference ops on the same dequantized
    values). Returns (stores, counters)."""
    _, config, model = tiny
    hybrid = copy.deepcopy(model)
    stores, counters = offload_experts(hybrid, config.moe_layers, slots, costs, cpu_kernels=False)
    got, logits = paged_greedy(paged_runner(hybrid, config), _prompts(), STEPS)
    assert got == reference[0]
    _same_logits(logits, reference[1])
    return stores, counters


@pytest.mark.parametrize(("costs", "slots"), [(ALWAYS_COPY, 3), (ALWAYS_CPU, 2), (MIXED, 2), (ALWAYS_COPY, 1)],
                         ids=["copy-lru", "cpu", "mixed", "one-slot"])
def test_greedy_ids_equal_the_all_resident_quantized_model(tiny, paged_runner, reference, costs, slots):
    _, config, _ = tiny
    stores, counters = _offloaded_run(tiny, paged_runner, reference, costs, slots)
    assert counters.hits + counters.misses > 0
    assert counters.misses == counters.copies + counters.cpu_runs
    if costs is ALWAYS_CPU:
        assert counters.copies == 0 and counters.cpu_runs == counters.misses and counters.hits == 0
    if costs is ALWAYS_COPY:
        assert counters.copies > 0 and counters.cpu_runs == 0
        if slots > 1:  # one slot may hold an expert every step needs
            assert (counters.evictions > 0) == (slots < config.num_experts)
    if costs is ALWAYS_COPY and slots < config.num_experts_per_tok:
        # No slot is evicted for an expert of the same step: the rest stream through.
        assert counters.streamed > 0
    if costs is MIXED:
        assert counters.copies > 0 and counters.cpu_runs > 0
    for s in stores:
        # Both tiers hold the file's blocks: every expert on the host, num_slots cached.
        assert isinstance(s.host, BlockStack) and isinstance(s.cache, BlockStack)
        assert s.host.num_experts == config.num_experts and s.num_slots == slots
        assert all(t.dtype == torch.uint8 for t in (*s.host.tensors, *s.cache.tensors))
        for e, slot in s.slot_of.items():
            assert all(torch.equal(c[slot], h[e]) for c, h in zip(s.cache.tensors, s.host.tensors, strict=True))


@pytest.mark.parametrize(("costs", "slots"), [(ALWAYS_CPU, 2), (MIXED, 2)], ids=["cpu", "mixed"])
def test_experts_run_by_the_c_kernels_give_the_all_resident_greedy_ids(tiny, paged_runner, reference, costs, slots):
    """The host tier's CPU runs in their blocks by the C kernels (Q4_K/Q6_K, Q8_0): the
    same greedy ids; logits within the kernels' rounding of the activations to 16-bit
    codes (about 2**-15 of a block's largest value, at gate/up and again at down)."""
    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build

    if cpu_kernels() is None:
        pytest.skip(f"the C CPU kernels do not build here: {build.why_not()}")
    _, config, model = tiny
    hybrid = copy.deepcopy(model)
    stores, counters = offload_experts(hybrid, config.moe_layers, slots, costs)
    assert all(s.cpu_kernels is not None for s in stores)
    got, logits = paged_greedy(paged_runner(hybrid, config), _prompts(), STEPS)
    assert got == reference[0]
    assert float((logits - reference[1]).abs().max()) <= 1e-3 * float(reference[1].abs().max())
    assert counters.cpu_runs > 0 and counters.misses == counters.copies + counters.cpu_runs


@pytest.mark.parametrize("slots", [0, 2])
def test_decode_reading_experts_over_the_bus_gives_the_all_resident_greedy_ids(tiny, paged_runner, reference, slots,
                                                                               monkeypatch):
    """Decode steps that read the missing experts from the host tier in place and the
    cached ones from their slots (engine.layers.moe.bus_reads; on CUDA the host tier is
    pinned memory the kernel reads over the bus): the reference kernel reads the same two
    tiers here, so ids and logits are the all-resident model's, while the hot-set
    refresh (every 4 steps here) fills the cache by routing heat."""
    from engine.layers.moe import expert_cache

    monkeypatch.setattr(OffloadedExperts, "_reads_over_bus", lambda self, x: x.shape[0] > 0)
    # With no slots, no refresh at all: the counts reach the counters when stats read them.
    monkeypatch.setattr(expert_cache, "REFRESH_STEPS", 4 if slots else 10**9)
    stores, counters = _offloaded_run(tiny, paged_runner, reference, ALWAYS_COPY, slots)
    for s in stores:
        s.count_bus_reads()  # as Engine.stats does
    assert counters.bus_reads > 0 and counters.copies == 0 and counters.cpu_runs == 0
    assert counters.misses == counters.bus_reads
    if slots:
        assert counters.swaps > 0 and counters.hits > 0
    for s in stores:
        assert torch.equal(s._bus.lut.cpu(), torch.tensor([s.slot_of.get(e, -1) for e in range(s.num_experts)]))


def test_a_cache_halved_mid_run_and_grown_back_keeps_outputs_equal(tiny, paged_runner, reference):
    _, config, model = tiny
    hybrid = copy.deepcopy(model)
    got, logits, _ = halved_cache_run(paged_runner(hybrid, config), _prompts(), STEPS, hybrid, config)
    assert got == reference[0]
    _same_logits(logits, reference[1])


def _layer(tiny) -> tuple[QuantExperts, int]:
    _, config, model = tiny
    return model.model.layers[config.moe_layers[0]].mlp.experts, config.hidden_size


def _routing(hidden: int, tokens: int, num_experts: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(tokens)])
    return x, torch.rand(tokens, 2, generator=gen), ids


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_step_routing_past_the_cache_streams_blocks_and_equals_the_resident_layer(tiny, slots):
    """Every expert in one step, fewer slots: the blocks stream through the slots in
    waves, and the output equals the resident blocks' exactly (the quantized product's
    reference, as the slots run it)."""
    experts, hidden = _layer(tiny)
    store = OffloadedExperts(stack_of(experts), torch.device("cpu"), slots, ExpertCounters(), ALWAYS_COPY)
    x, w, ids = _routing(hidden, 12, experts.num_experts)
    want = fused_moe_quant(x, experts.gate, experts.up, experts.down, experts.types, w, ids)
    assert torch.equal(store(x, w, ids), want)
    c = store.counters
    assert c.streamed == experts.num_experts - slots and c.copies == experts.num_experts and c.cpu_runs == 0
    assert len(store.slot_of) == slots


def test_a_cpu_run_dequantizes_the_host_blocks(tiny):
    experts, hidden = _layer(tiny)
    store = OffloadedExperts(stack_of(experts), torch.device("cpu"), 2, ExpertCounters(), ALWAYS_CPU)
    x, w, ids = _routing(hidden, 5, experts.num_experts, seed=2)
    got = store(x, w, ids)
    assert torch.equal(got, fused_moe_quant(x, experts.gate, experts.up, experts.down, experts.types, w, ids))
    assert store.counters.cpu_runs == len(torch.unique(ids)) and not store.slot_of


def test_a_copy_moves_the_blocks_and_the_cost_model_counts_their_bytes(tiny):
    """A slot is one expert's blocks, a fraction of its bfloat16 bytes (bits a weight:
    Q4_K 4.5, Q6_K 6.5625, Q8_0 8.5, against 16), and the measured copy cost is for
    those bytes."""
    experts, hidden = _layer(tiny)
    blocks = sum(b[0].nbytes for b in (experts.gate, experts.up, experts.down))
    weights = 3 * hidden * experts.intermediate_size
    bits = {"Q4_K": 4.5, "Q6_K": 6.5625, "Q8_0": 8.5}
    assert blocks * 8 == sum(bits[t] for t in experts.types) * weights / 3 < weights * 16 * 0.54
    store = OffloadedExperts(stack_of(experts), torch.device("cpu"), 2, ExpertCounters(), ALWAYS_COPY)
    assert store.slot_bytes == blocks
    assert store.cache.gate.shape == (2, *experts.gate.shape[1:]) and store.cache.gate.dtype == torch.uint8
    costs = measure_stack_costs(store.host, torch.device("cpu"), repeats=1)
    assert costs.expert_bytes == blocks and costs.copy_bytes_per_s > 0
    assert costs.cpu_s(256) >= costs.cpu_s(1) > 0  # the CPU run includes the dequantization
    before = dataclasses.replace(store.counters)
    x, w, ids = _routing(hidden, 1, experts.num_experts, seed=3)
    store(x, w, ids)
    assert store.counters.copies - before.copies == 2


def test_the_plan_prices_the_host_tier_and_the_expert_cache_in_block_bytes(tiny):
    """--cpu-experts 1 on a simulated card, the GGUF in blocks: the host tier is the last
    MoE layer's blocks, a slot one expert's blocks (the largest expert of the host
    layers), all as the loader allocates them; the dense plan of the same model charges
    more for each."""
    from engine.core.footprint import make_footprint
    from engine.memory.device import simulated_device
    from engine.memory.ledger import make_plan
    from engine.memory.plan import PlanKnobs

    path, config, model = tiny
    size = gguf_weight_size(path, config, torch.float32, "cuda")
    layer_bytes = tuple(sum(b.nbytes for b in model.model.layers[i].mlp.experts.buffers()) for i in config.moe_layers)
    assert size.expert_layer_bytes == layer_bytes and size.experts_in_blocks
    knobs = PlanKnobs(cpu_experts="1")
    blocks = make_plan(simulated_device(8 << 30), knobs, make_footprint(config, torch.float32, knobs, weights=size))
    dense = make_plan(simulated_device(8 << 30), knobs, make_footprint(config, torch.float32, knobs))
    slot = max(-(-b // config.num_experts) for b in layer_bytes[-1:])
    assert blocks.cpu_expert_layers == 1 and blocks.expert_slot_bytes == slot < dense.expert_slot_bytes / 3
    lines = {e.name: e for e in blocks.ledger}
    assert lines["routed expert weights"].bytes == sum(layer_bytes[:-1])
    assert "GGUF blocks" in lines["routed expert weights"].source
    assert blocks.expert_cache_slots > 0 and lines["expert cache"].bytes == blocks.expert_cache_slots * slot
    assert "GGUF blocks" in lines["expert cache"].source
    assert lines["weights"].bytes + sum(layer_bytes) == size.bytes


def test_plan_command_shows_the_block_figures_with_cpu_experts(tiny, tmp_path):
    """``headroom plan --gguf-quantized --cpu-experts 1`` on a MoE GGUF keeps the blocks
    (no dequantizing fallback) and prints the host tier and the slots at block size."""
    import os

    from click.testing import CliRunner

    from engine.memory.plan import fmt_bytes
    from service.cli.commands import main

    path, config, model = tiny
    args = ["plan", "--model", str(path), "--device", "cuda", "--device-total", "4GiB", "--gguf-quantized",
            "--cpu-experts", "1"]
    result = CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_CACHE_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    host = sum(b.nbytes for b in model.model.layers[config.moe_layers[-1]].mlp.experts.buffers())
    assert f"1 ({fmt_bytes(host)}) in pinned host memory" in result.stdout
    assert f"of {fmt_bytes(host // config.num_experts)} (GGUF blocks)" in result.stdout


def test_a_resident_layer_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="cannot offload routed experts held as Linear"):
        stack_of(torch.nn.Linear(2, 2))


def test_the_quantized_reference_layer_matches_its_block_stack(tiny):
    """The stack's dense weights of an expert are the resident reference's, so a CPU run
    computes what QuantExperts computes for that expert."""
    experts, _ = _layer(tiny)
    stack = stack_of(experts)
    assert stack.types == experts.types and (stack.types == EXPERT_TYPES or stack.types == ("Q8_0",) * 3)
    gate_up, down = stack.weights_of(1, torch.float32)
    assert gate_up.shape == (2 * experts.intermediate_size, experts.hidden_size)
    assert down.shape == (experts.hidden_size, experts.intermediate_size)


def test_a_cpu_engine_with_a_hybrid_plan_loads_the_gguf_in_blocks_and_decodes_the_same_ids(tiny, tmp_path,
                                                                                             monkeypatch):
    """--cpu-experts 1 on a simulated card, the CPU engine's GGUF layout (projections
    repacked, experts dequantized at load, as on the CPU they always are): the hybrid
    load reads the file as the all-resident one does and decodes the same ids."""
    from engine.common.config import EngineConfig
    from engine.layers.moe.expert_stacks import DenseStack

    path, config, _ = tiny
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))  # the file's conversion goes there

    def greedy(cpu_experts: str):
        return engine_greedy(EngineConfig(model=str(path), device="cpu", dtype="float32", device_total=8 << 30,
                                          cpu_experts=cpu_experts, max_running_requests=4, gguf_quantized=True),
                             _prompts(), 12)

    hybrid, got = greedy("1")
    whole, ref = greedy("none")
    assert got == ref
    assert _interleaved_where_taken(whole.model, config)  # the all-resident CPU engine's experts: by 16 rows
    assert hybrid.quantized_gguf == whole.quantized_gguf == path
    assert hybrid.plan.cpu_expert_layers == 1 and len(hybrid.expert_stores) == 1
    assert isinstance(hybrid.expert_stores[0].host, DenseStack)
    stats = hybrid.stats()
    assert stats.expert_cache_hits + stats.expert_cache_misses > 0


def _interleaved_where_taken(model, config) -> bool:
    """Whether every MoE layer's experts are of interleaved types (``Q4_Kx16``...) where the
    C kernels multiply that layout (:mod:`kernels.cpu.rows16`) and the file's types where
    they do not."""
    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import rows16

    lib = cpu_kernels()
    on = lib is not None and rows16.available(lib)
    types = [model.model.layers[i].mlp.experts.types for i in config.moe_layers]
    return all(all(t.endswith(rows16.SUFFIX) == on for t in ts) for ts in types)


def test_a_cpu_model_s_experts_interleaved_by_16_rows_give_the_all_resident_greedy_ids(tiny, paged_runner, reference):
    """The CPU engine's layout (pack_model_for_cpu): each expert's rows interleaved by 16
    where the build multiplies that layout, run by the C kernels; the same greedy ids as
    the all-resident model's reference, logits within the kernels' activation rounding;
    the loaded model's own blocks are left in the file's layout."""
    from engine.layers.cpu_pack import pack_model_for_cpu
    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build

    lib = cpu_kernels()
    if lib is None:
        pytest.skip(f"the C CPU kernels do not build here: {build.why_not()}")
    _, config, model = tiny
    packed = pack_model_for_cpu(copy.deepcopy(model), torch.float32, lib)
    assert _interleaved_where_taken(packed, config)
    assert all(model.model.layers[i].mlp.experts.types in (EXPERT_TYPES, ("Q8_0",) * 3) for i in config.moe_layers)
    got, logits = paged_greedy(paged_runner(packed, config), _prompts(), STEPS)
    assert got == reference[0]
    assert float((logits - reference[1]).abs().max()) <= 1e-3 * float(reference[1].abs().max())
    # The C kernels switched off after the load: the reference over the blocks put back.
    from kernels.switches import using

    i = config.moe_layers[0]
    x, ids = torch.randn(3, config.hidden_size), torch.tensor([[0, 1], [1, 2], [3, 0]])
    with using(cpu_kernels=False):
        got = packed.model.layers[i].mlp.experts(x, torch.full((3, 2), 0.5), ids)
        assert torch.equal(got, model.model.layers[i].mlp.experts(x, torch.full((3, 2), 0.5), ids))
