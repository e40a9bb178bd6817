"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5: Gated DeltaNet layers between
gated full-attention layers) against transformers on tiny random configs, dense and with
MoE layers (Qwen3.5-MoE as the vision-language checkpoint it is published in, of which
the language model runs): logits over the paged KV cache and the state pool, greedy
decoding through the engine, chunked prefill, state slots given back, and the plan's
state-pool line (Qwen3-Next-80B-A3B's published shape, no weights read)."""

from __future__ import annotations

import pytest
import torch
from model_checks import check_extend_and_decode, check_ragged_batch, hf_greedy, pair_fixture
from test_engine import run_all

from engine.bench.model_shapes import write_shape
from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.core.footprint import (
    estimate_activation_bytes,
    linear_attention_activation_bytes,
    make_footprint,
)
from engine.kvcache.state_pool import StatePool, state_bytes_per_request
from engine.layers.gated_deltanet import gated_delta_rule_chunked, gated_delta_rule_ref
from engine.loader.hf_config import load_model_config
from engine.loader.weight_size import parameter_count, weight_bytes
from engine.memory.device import simulated_device
from engine.memory.ledger import make_plan
from engine.memory.plan import GiB, PlanKnobs
from engine.wire.messages import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 256
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


# Each kind's routed layers: Qwen3-Next's layer 1 is dense (mlp_only_layers); Qwen3.5-MoE
# routes every layer.
MOE_LAYERS = {"qwen3_next_dense": (), "qwen3_next": (0, 2, 3), "qwen3_5": (), "qwen3_5_moe_vl": (0, 1, 2, 3)}

pair = pair_fixture(list(MOE_LAYERS), VOCAB)


def test_layer_layout_follows_the_config(pair):
    kind, hf, ours, config, _ = pair
    text = hf.config.get_text_config()
    assert config.layer_types == tuple(text.layer_types)
    assert config.linear_layers == (0, 2) and config.kv_layers == (1, 3)
    assert config.rotary_dim == 8  # head_dim 16, partial_rotary_factor 0.5
    layers = hf.model.language_model.layers if hasattr(hf.model, "language_model") else hf.model.layers
    hf_sparse = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert config.moe_layers == hf_sparse == MOE_LAYERS[kind]
    # A vision-language checkpoint: the language model's parameters, not the vision tower's.
    language_model = [p for n, p in hf.named_parameters() if not n.startswith("model.visual.")]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in language_model)
    held = sum(p.nbytes for p in ours.parameters()) + ours.cos_sin_cache.nbytes
    assert weight_bytes(config, torch.float32) == held


def test_prefill_extend_and_decode_match_transformers(pair, paged_runner):
    _, hf, ours, config, _ = pair
    check_extend_and_decode(hf, paged_runner(ours, config), VOCAB)


def test_ragged_batch_matches_transformers(pair, paged_runner):
    """Two sequences in every step, each with its own state slot."""
    _, hf, ours, config, _ = pair
    check_ragged_batch(hf, paged_runner(ours, config), VOCAB)


def test_greedy_32_steps_equal_transformers(pair):
    """Three prompts batched through the engine (scheduler, state slots, KV pages)."""
    _, hf, _, _, path = pair
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=128))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 23)]
    ours = run_all(engine, {f"r{i}": (ids, GREEDY) for i, ids in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        assert ours[f"r{i}"] == hf_greedy(hf, ids, 32)


def test_chunked_prefill_16_tokens_equals_one_chunk(pair):
    """The conv and recurrent states carry from chunk to chunk."""
    _, _, _, _, path = pair
    ids = torch.randint(3, VOCAB, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    chunked = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64, max_prefill_tokens=16))
    whole = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64, max_prefill_tokens=128))
    assert run_all(chunked, {"c": (ids, sp)}) == run_all(whole, {"c": (ids, sp)})


def test_the_chunked_delta_rule_equals_the_token_by_token_one():
    """Three chunks of 64, the last padded, from a nonzero state: outputs and the state
    after them."""
    g = torch.Generator().manual_seed(6)
    t, h, dk, dv = 150, 3, 16, 24
    q, k = torch.randn(t, h, dk, generator=g), torch.randn(t, h, dk, generator=g)
    v, state = torch.randn(t, h, dv, generator=g), torch.randn(h, dk, dv, generator=g)
    decay, beta = -torch.rand(t, h, generator=g), torch.rand(t, h, generator=g)
    ref_out, ref_state = gated_delta_rule_ref(q, k, v, decay, beta, state)
    out, after = gated_delta_rule_chunked(q, k, v, decay, beta, state)
    assert out.shape == ref_out.shape and after.shape == ref_state.shape
    assert float((out - ref_out).abs().max()) < 1e-5 and float((after - ref_state).abs().max()) < 1e-5


def test_state_slots_come_back_after_finish_and_abort(pair):
    _, _, _, _, path = pair
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64, max_running_requests=2))
    states = engine.states
    assert states.max_requests == 2 and states.num_free == 2
    # The prefix cache keeps checkpoints of states (tests/test_hybrid_prefix_cache.py).
    assert engine.radix is not None and states.checkpoints == 2
    sp = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8], sampling=sp))
    engine.step()
    # Two slots bound the running requests; the third waits.
    assert states.num_free == 0
    assert {r.request_id for r in engine.scheduler.running} == {"a", "b"}
    engine.abort("a")
    assert states.num_free == 1
    ended = set()
    while engine.has_work():
        ended |= {o.request_id for o in engine.step() if o.finished}
    assert ended >= {"b", "c"}
    assert states.num_free == 2


def test_a_preempted_request_gives_its_slot_back_and_recomputes(pair):
    _, _, _, _, path = pair
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64))
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [9, 10, 11, 12, 13, 14]
    alone = run_all(engine, {"x": (ids, sp)})["x"]
    engine.add_request(GenerateRequest(request_id="y", prompt_token_ids=ids, sampling=sp))
    out = engine.step()[0].token_ids
    free = engine.states.num_free
    engine.scheduler.preempt(engine.scheduler.requests["y"])
    assert engine.states.num_free == free + 1
    while engine.has_work():
        for o in engine.step():
            out += o.token_ids
    assert out == alone


# Published shapes: (linear layers, full-attention layers, parameters in billions).
PUBLISHED = {"qwen3-next-80b-a3b": (36, 12, 79.7), "qwen3.6-35b-a3b": (30, 10, 34.7)}


@pytest.mark.parametrize("shape", list(PUBLISHED))
def test_plan_charges_the_state_pool_on_its_own_line(shape, tmp_path):
    mc = load_model_config(write_shape(shape, tmp_path))
    linear, full, billions = PUBLISHED[shape]
    assert mc.is_hybrid and len(mc.linear_layers) == linear and mc.num_kv_layers == full
    assert round(parameter_count(mc) / 1e9, 1) == billions  # Qwen3.6: the language model
    knobs = PlanKnobs(max_running_requests=8)
    plan = make_plan(simulated_device(80 * GiB), knobs, make_footprint(mc, torch.bfloat16, knobs))
    ledger = {e.name: e for e in plan.ledger}
    per_request = state_bytes_per_request(mc, torch.bfloat16)
    # Per linear layer 32 x 128 x 128 x 4 recurrent + 8192 x 3 x 2 conv: 75.2 MiB per
    # request for Qwen3-Next-80B-A3B's 36 layers.
    assert per_request == linear * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    # The null slot and the prefix cache's checkpoints too.
    assert ledger["linear-attention state pool"].bytes == (8 + 1 + 8) * per_request
    assert "8 requests + 1 null slot + 8 prefix-cache checkpoints" in ledger["linear-attention state pool"].source
    assert plan.table().count("linear-attention state pool") == 1
    # A KV page holds the full-attention layers only.
    assert ledger["KV cache pool"].bytes == plan.num_pages * 2 * full * 2 * 256 * 2 * knobs.page_size


def test_the_state_pool_is_the_size_the_plan_charges(tmp_path):
    tiny = load_model_config(write_shape("qwen3-next-80b-a3b", tmp_path / "tiny", num_hidden_layers=4))
    assert StatePool(tiny, 3, torch.bfloat16, "meta").nbytes == (3 + 1) * state_bytes_per_request(tiny, torch.bfloat16)


def test_linear_attention_transient_is_priced_at_the_chunk(tmp_path):
    mc = load_model_config(write_shape("qwen3-next-80b-a3b", tmp_path))
    small = linear_attention_activation_bytes(mc, 2048, 2)
    large = linear_attention_activation_bytes(mc, 8192, 2)
    assert 3.9 < large / small < 4.1  # linear in the chunk
    knobs = PlanKnobs(max_prefill_tokens=8192, max_running_requests=1)
    assert estimate_activation_bytes(mc, torch.bfloat16, knobs) > large


def test_a_small_card_lowers_the_running_requests_before_the_chunk(tmp_path):
    """Qwen3.6-35B-A3B's 64 running requests hold about 4 GiB of states (and their
    checkpoints): on a 6 GiB card no chunk fits them, every expert in host memory. The
    plan takes the most running requests that fit at the configured chunk (a smaller
    chunk would stream the host experts through the GPU 8 times as often); a dense
    model's rule halves the chunk first."""
    from engine.core.footprint import CUDA_RUNTIME_ESTIMATE_BYTES
    from engine.memory.plan_fit import fit_plan

    mc = load_model_config(write_shape("qwen3.6-35b-a3b", tmp_path))
    device = simulated_device(6 * GiB)

    def planner(k: PlanKnobs):
        return make_plan(device, k, make_footprint(mc, torch.bfloat16, k, runtime_bytes=CUDA_RUNTIME_ESTIMATE_BYTES,
                                                   gathers_context=False))

    knobs = PlanKnobs(cpu_experts="auto")
    assert not planner(knobs).fits
    plan, fitted = fit_plan(planner, knobs, fewer_requests=True, fewer_requests_first=True)
    assert plan.fits and plan.cpu_expert_layers == 40 and fitted.max_prefill_tokens == knobs.max_prefill_tokens
    assert 1 <= fitted.max_running_requests < knobs.max_running_requests
    assert not planner(PlanKnobs(cpu_experts="auto", max_running_requests=fitted.max_running_requests + 1)).fits
    assert f"{fitted.max_running_requests} requests + 1 null slot" in plan.table()
    dense_rule, halved = fit_plan(planner, knobs, fewer_requests=True)
    assert dense_rule.fits and halved.max_prefill_tokens < knobs.max_prefill_tokens


@pytest.mark.parametrize("card_gib", [8, 12])
def test_a_hybrid_s_states_take_at_most_an_eighth_of_the_budget(tmp_path, card_gib):
    """With --max-running-requests unset, Qwen3.6-35B-A3B's state pool takes at most an
    eighth of the budget (at least 4 requests): the room 64 states took goes to experts on
    the device and context, and the plan says why it runs fewer; a number typed is kept."""
    from engine.core.footprint import CUDA_RUNTIME_ESTIMATE_BYTES
    from engine.memory.plan_fit import (
        STATE_BUDGET_SHARE,
        STATE_FLOOR_REQUESTS,
        fit_model_plan,
        requests_for_states,
    )

    mc = load_model_config(write_shape("qwen3.6-35b-a3b", tmp_path))

    def planner_of(gib: int):
        device = simulated_device(gib * GiB)
        return lambda k: make_plan(device, k, make_footprint(mc, torch.bfloat16, k, gathers_context=False,
                                                             runtime_bytes=CUDA_RUNTIME_ESTIMATE_BYTES))

    def states(plan, n: int) -> int:
        return (n + 1 + min(n, 8)) * plan.state_bytes_per_request

    knobs, planner = PlanKnobs(cpu_experts="auto"), planner_of(card_gib)
    plan, fitted = fit_model_plan(planner, knobs, EngineConfig(), mc)
    typed, kept = fit_model_plan(planner_of(24), knobs, EngineConfig(max_running_requests=64), mc)
    auto24, _ = fit_model_plan(planner_of(24), knobs, EngineConfig(), mc)
    n = fitted.max_running_requests
    assert plan.fits and 4 < n < 64 and f"{n} requests + 1 null slot" in plan.table()
    assert states(plan, n) <= plan.budget_bytes // STATE_BUDGET_SHARE < states(plan, n + 1)
    assert plan.requests_note.startswith("not 64: the linear-attention states take at most 1/8 of the budget")
    assert kept.max_running_requests == 64 and typed.requests_note == ""
    assert auto24.cpu_expert_layers < typed.cpu_expert_layers  # the states' room holds experts
    # Never below llama-server's 4 slots, where a card fits them at all.
    assert requests_for_states(planner_of(3), knobs).max_running_requests == STATE_FLOOR_REQUESTS


def test_an_engine_on_a_card_too_small_for_64_states_runs_fewer_requests(tmp_path, make_tiny_hf_model):
    """A tiny Qwen3-Next with wide linear-attention heads (a state of over 512 KiB a request) on
    a simulated card that holds the plan with 64 running requests' states less 48 of
    them: with --max-running-requests unset the engine starts with the most that fit
    (logged, reported in its info) and three requests decode as on a large card; 64
    typed is refused, naming the number that fits."""
    from model_checks import engine_greedy

    from engine.commands.plan import build_plan, render
    from engine.common.errors import PlanDoesNotFit

    make_tiny_hf_model("qwen3_next", tmp_path, vocab_size=256, linear_num_value_heads=16, linear_value_head_dim=64,
                       linear_key_head_dim=64)
    per_request = state_bytes_per_request(load_model_config(tmp_path), torch.float32)
    assert per_request >= 512 << 10

    def config(total: int, requests: int | None = None) -> EngineConfig:
        return EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", device_total=total,
                            max_running_requests=requests)

    low, high = 256 << 20, 4 << 30  # the smallest card (to 1 MiB) whose plan holds 64 requests
    while high - low > 1 << 20:
        mid = (low + high) // 2
        low, high = (low, mid) if build_plan(config(mid, 64)).fits else (mid, high)
    card = high - 48 * per_request
    prompts = {k: [(7 * i + n) % 250 + 3 for i in range(n)] for k, n in (("a", 9), ("b", 17), ("c", 5))}
    small, got = engine_greedy(config(card), prompts, 12)
    _, ref = engine_greedy(config(high), prompts, 12)
    assert got == ref
    assert 3 <= small.knobs.max_running_requests < 64
    assert small.info.max_running_requests == small.knobs.max_running_requests == small.states.max_requests
    assert small.scheduler.max_running_requests == small.knobs.max_running_requests
    # headroom plan says what the engine does.
    assert f"running requests: {small.knobs.max_running_requests} at most" in render(build_plan(config(card)), False)
    with pytest.raises(PlanDoesNotFit, match="--max-running-requests 64 →"):
        Engine(config(card, 64))
