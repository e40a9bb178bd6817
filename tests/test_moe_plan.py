"""The memory plan of a mixture of experts: the routed experts' weights on a ledger line
of their own (all on the device), and the sparse MLP's prefill transient (a copy of
each token per routed choice) in the activation estimate. Shapes of Qwen3-30B-A3B,
from its published config (no weights are read)."""

from __future__ import annotations

import dataclasses

import torch

from engine.bench.model_shapes import write_shape
from engine.core.footprint import estimate_activation_bytes, make_footprint, moe_activation_bytes
from engine.loader.hf_config import load_model_config
from engine.loader.weight_size import expert_weight_bytes, weight_bytes
from engine.memory.device import simulated_device
from engine.memory.ledger import make_plan
from engine.memory.plan import GiB, PlanKnobs


def _config(tmp_path, **overrides):
    return load_model_config(write_shape("qwen3-30b-a3b", tmp_path, **overrides))


def test_routed_experts_are_charged_on_their_own_line(tmp_path):
    mc = _config(tmp_path)
    assert mc.moe_layers == tuple(range(48)) and mc.num_experts == 128 and mc.num_experts_per_tok == 8
    knobs = PlanKnobs()
    plan = make_plan(simulated_device(80 * GiB), knobs, make_footprint(mc, torch.bfloat16, knobs))
    ledger = {e.name: e.bytes for e in plan.ledger}
    experts = 48 * 128 * 3 * 2048 * 768 * 2  # layers x experts x (gate, up, down) x H x I x bf16
    assert ledger["routed expert weights"] == experts == expert_weight_bytes(mc, torch.bfloat16)
    assert ledger["weights"] + experts == weight_bytes(mc, torch.bfloat16)
    assert plan.fits  # 57 GiB of weights on an 80 GiB card
    whole = PlanKnobs(cpu_experts="none")
    small = make_plan(simulated_device(24 * GiB), whole, make_footprint(mc, torch.bfloat16, whole))
    assert not small.fits


def test_a_dense_model_has_no_expert_line(tmp_path):
    mc = load_model_config(write_shape("qwen3-0.6b", tmp_path))
    knobs = PlanKnobs()
    plan = make_plan(simulated_device(8 * GiB), knobs, make_footprint(mc, torch.bfloat16, knobs))
    assert "routed expert weights" not in {e.name for e in plan.ledger}
    assert expert_weight_bytes(mc, torch.bfloat16) == 0


def test_prefill_activation_prices_the_routed_token_copies(tmp_path):
    mc = _config(tmp_path)
    knobs = PlanKnobs(max_prefill_tokens=4096)
    t, it = 4096, 2
    routed = moe_activation_bytes(mc, t, it)
    # At least the activations and down products of every routed copy, at most twice that.
    copies = t * 8 * (768 + 2048) * it
    assert copies < routed < 2 * copies
    assert estimate_activation_bytes(mc, torch.bfloat16, knobs) >= routed
    # More experts per token, more copies; a dense layer's MLP still counts where it is larger.
    top16 = dataclasses.replace(mc, num_experts_per_tok=16)
    assert moe_activation_bytes(top16, t, it) > routed
    with_dense = dataclasses.replace(mc, moe_layers=mc.moe_layers[1:], intermediate_size=60000)
    assert estimate_activation_bytes(with_dense, torch.bfloat16, knobs) > estimate_activation_bytes(
        mc, torch.bfloat16, knobs
    )


def test_shared_expert_adds_its_transient(tmp_path):
    mc = _config(tmp_path)
    shared = dataclasses.replace(mc, shared_expert_intermediate_size=5632)
    assert moe_activation_bytes(shared, 512, 2) - moe_activation_bytes(mc, 512, 2) == 512 * (3 * 5632 + 2048) * 2


def test_a_card_too_small_for_every_expert_plans_hybrid(tmp_path):
    """24 GiB cannot hold Qwen3-30B-A3B's 57 GiB: auto puts the fewest layers' routed
    experts in host memory and gives an expert cache the half of what is left; none
    does not fit, and its message names --cpu-experts with its price."""
    mc = _config(tmp_path)
    dev = simulated_device(24 * GiB)

    def plan(cpu_experts: str):
        knobs = PlanKnobs(cpu_experts=cpu_experts)
        return make_plan(dev, knobs, make_footprint(mc, torch.bfloat16, knobs))

    hybrid = plan("auto")
    assert hybrid.fits and 0 < hybrid.cpu_expert_layers < 48
    slot = 3 * 2048 * 768 * 2
    assert hybrid.expert_slot_bytes == slot
    ledger = {e.name: e for e in hybrid.ledger}
    per_layer = 128 * slot
    assert ledger["routed expert weights"].bytes == (48 - hybrid.cpu_expert_layers) * per_layer
    assert ledger["expert cache"].bytes == hybrid.expert_cache_slots * slot > 0
    assert "in pinned host memory" in ledger["routed expert weights"].source
    # One layer fewer in host memory does not fit: auto took the fewest.
    assert not plan(str(hybrid.cpu_expert_layers - 1)).fits
    # The cache took half of what one min-context request's KV left; the pool the rest.
    assert hybrid.kv_pool_bytes + 2 * slot >= ledger["expert cache"].bytes
    whole = plan("none")
    assert not whole.fits and whole.cpu_expert_layers == 0 and "expert cache" not in {e.name for e in whole.ledger}
    text = whole.message()
    assert "--cpu-experts none → " in text and "copied over PCIe or run on the CPU" in text
    assert plan("48").cpu_expert_layers == 48 and plan("99").cpu_expert_layers == 48


def test_a_card_that_holds_every_expert_offloads_none(tmp_path):
    mc = _config(tmp_path)
    knobs = PlanKnobs()
    plan = make_plan(simulated_device(80 * GiB), knobs, make_footprint(mc, torch.bfloat16, knobs))
    assert plan.fits and plan.cpu_expert_layers == 0 and plan.expert_cache_slots == 0



def test_paged_attention_leaves_the_context_out_of_the_estimate_and_a_small_card_keeps_more_experts(tmp_path):
    """The paged kernels (Triton, FlashInfer) read a chunk's context in place; only the
    torch backend copies it out. Charging that copy at the model's 40,960-token context
    priced about 1.1 GiB that the Triton backend never allocates, and the placement, made
    from the estimate before the weights load, kept fewer layers' experts on the device
    for it (on a 6 GiB card and the Q4_K file: 8 layers of 48 where 11 fit)."""
    mc = _config(tmp_path)
    knobs = PlanKnobs(cpu_experts="auto")
    t, it, s = knobs.max_prefill_tokens, 2, mc.max_position_embeddings
    gathered = estimate_activation_bytes(mc, torch.bfloat16, knobs)
    paged = estimate_activation_bytes(mc, torch.bfloat16, knobs, gathers_context=False)
    # The chunk's context, gathered and expanded to all heads, is the difference at least.
    assert gathered - paged >= 2 * s * (mc.kv_size + mc.q_size) * it
    assert paged >= moe_activation_bytes(mc, t, it)  # the routed copies are still charged

    def on_device(gathers: bool) -> int:
        fp = make_footprint(mc, torch.bfloat16, knobs, gathers_context=gathers)
        plan = make_plan(simulated_device(8 * GiB), knobs, fp)  # bfloat16 experts: 1.1 GiB a layer
        assert plan.fits
        return 48 - plan.cpu_expert_layers

    assert on_device(False) > on_device(True)


def test_the_auto_placement_keeps_a_margin_for_what_a_profile_may_measure_more(tmp_path):
    """From estimates, the fewest host layers that leave PLACEMENT_MARGIN_BYTES beyond one
    --min-context request (the expert cache and the KV pages past it, which a measured
    plan can give back); a measured footprint plans with no margin. On an H200 as a 6 GiB
    card, the measured plan of the placement made with no margin came 113 MiB short and
    the engine could not start."""
    from engine.memory.ledger import PLACEMENT_MARGIN_BYTES, _ledger_at, _spare

    mc = _config(tmp_path)
    knobs = PlanKnobs(cpu_experts="auto")
    fp = make_footprint(mc, torch.bfloat16, knobs, gathers_context=False)
    device = simulated_device(12 * GiB)  # bfloat16 experts, 1.1 GiB a layer
    plan = make_plan(device, knobs, fp)
    host = plan.cpu_expert_layers
    assert plan.fits and _spare(plan) >= PLACEMENT_MARGIN_BYTES
    fewer = _ledger_at(device, knobs, fp, host - 1)  # one layer more on the device: fits, but tight
    assert fewer.fits and _spare(fewer) < PLACEMENT_MARGIN_BYTES
    measured = dataclasses.replace(fp, activation_source="measured")
    assert make_plan(device, knobs, measured).cpu_expert_layers == host - 1


def test_a_measured_footprint_above_the_estimates_places_more_experts_in_host_memory(tmp_path):
    """What the engine's re-placement after its profile run reads (engine.core.plan_stages,
    _fit_measured): the estimates' placement, priced by a footprint that measured more
    than its margin above them (a Qwen3.6-35B-A3B-shape GGUF at --device-limit 12GiB on an
    H100 measured the CUDA context 422 MiB and the decode graphs 452 MiB above the
    estimates, and failed to start), does not fit; the auto placement by that footprint
    keeps the fewest more layers' experts in host memory that fit."""
    from engine.core.footprint import CUDA_RUNTIME_ESTIMATE_BYTES
    from engine.memory.ledger import _spare

    mc = _config(tmp_path)
    knobs = PlanKnobs(cpu_experts="auto")
    fp = make_footprint(mc, torch.bfloat16, knobs, gathers_context=False, runtime_bytes=CUDA_RUNTIME_ESTIMATE_BYTES)
    device = simulated_device(12 * GiB)  # bfloat16 experts, 1.1 GiB a layer
    placed = make_plan(device, knobs, fp)
    host = placed.cpu_expert_layers
    assert placed.fits and host > 0
    measured = dataclasses.replace(fp, activation_source="measured", runtime_source="measured",
                                   runtime_bytes=CUDA_RUNTIME_ESTIMATE_BYTES + (422 << 20),
                                   cuda_graph_bytes=_spare(placed) - (422 << 20) + (600 << 20))
    assert not make_plan(device, dataclasses.replace(knobs, cpu_experts=str(host)), measured).fits
    again = make_plan(device, knobs, measured)
    assert again.fits and again.cpu_expert_layers == host + 1
