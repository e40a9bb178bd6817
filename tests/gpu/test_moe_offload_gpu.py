"""Routed experts in pinned host memory with a GPU expert cache, on CUDA.

1. A tiny Qwen3-MoE in bfloat16 through a paged KV pool: with its experts offloaded to a
   cache of 3 of 8 slots (copies, streamed waves and LRU evictions all happen), greedy ids for
   32 steps equal the all-resident model's (fused Triton kernel both ways), the last
   logits agree within 1e-2 absolute (bfloat16: a CPU-run expert rounds apart), and a
   cache halved mid-run keeps the ids.
2. The routed experts of a Qwen3-30B-A3B shape (H 2048, I 768, 128 experts, top 8) with
   Zipf-skewed routing, cache slots as the plan gives a 12 GiB card: the MoE layers'
   time per decode step at batch 1 and 16, hybrid against all on the GPU, and the hit
   rate, with the slots the plan gives a 12 GiB card and with 32 per layer; printed (no
   wall-clock assertion).
3. A prefill chunk of 2,048 tokens through one such layer with 16 slots: the experts
   the cache cannot hold and a copy serves best stream through it on the side stream,
   the output equals the all-resident layer's within bfloat16 rounding; the time per
   layer is printed beside the copies alone, every expert on the CPU, and the layer
   resident.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from model_checks import paged_greedy

from engine.layers.moe.expert_cache import OffloadedExperts
from engine.layers.moe.expert_costs import ALWAYS_COPY, ALWAYS_CPU, measure_costs
from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.expert_stacks import DenseStack
from engine.layers.moe.offload import offload_experts, resize_cache
from engine.loader.load import load_model
from kernels.dispatch import fused_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCAB, STEPS = 512, 32


def test_hybrid_tiny_qwen3_moe_equals_all_resident_in_bf16(tmp_path, make_tiny_hf_model, paged_runner):
    make_tiny_hf_model("qwen3_moe", tmp_path, vocab_size=VOCAB)
    model, config = load_model(tmp_path, "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = {k: torch.randint(3, VOCAB, (n,), generator=g).tolist() for k, n in (("a", 9), ("b", 30))}
    ref, ref_logits = paged_greedy(paged_runner(model, config, device="cuda"), prompts, STEPS)
    hybrid = copy.deepcopy(model)
    stores, counters = offload_experts(hybrid, config.moe_layers, 3)
    assert stores[0].host.gate_up.is_pinned() and stores[0].cache.gate_up.is_cuda

    def halve(i):
        if i == 16:
            resize_cache(stores, 1)

    got, logits = paged_greedy(paged_runner(hybrid, config, device="cuda"), prompts, STEPS, halve)
    print(f"\ntiny qwen3_moe bf16 hybrid: {counters} costs={stores[0].costs}")
    assert got == ref
    assert (logits - ref_logits).abs().max().item() < 1e-2
    assert counters.copies > 0 and counters.evictions > 0


def _zipf_route(tokens, experts, top_k, gen, perm, s=1.2):
    """Each token's ``top_k`` experts drawn by Zipf(``s``) over ``perm`` (the layer's
    fixed order of heat, so the hot experts stay hot from step to step)."""
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    ids = torch.stack([perm[torch.multinomial(p, top_k, replacement=False, generator=gen)] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    return (w / w.sum(-1, keepdim=True)), ids


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("slots", ["plan", 32])
def test_qwen3_30b_a3b_expert_layers_hybrid_vs_resident(batch, slots):
    from engine.memory.device import simulated_device
    from engine.memory.ledger import make_plan
    from engine.memory.plan import Footprint, GiB, PlanKnobs

    hdim, inter, experts, top_k, layers = 2048, 768, 128, 8, 4
    slot = 3 * hdim * inter * 2
    fp = Footprint(weight_bytes=61_000_000_000, kv_bytes_per_token=98304, vocab_size=151936,
                   model_context_tokens=40960, expert_weight_bytes=48 * experts * slot, expert_layers=48,
                   num_experts=experts, runtime_bytes=512 << 20)
    plan = make_plan(simulated_device(12 * GiB), PlanKnobs(), fp)
    per_layer = max(plan.expert_cache_slots // max(plan.cpu_expert_layers, 1), top_k) if slots == "plan" else slots
    gen = torch.Generator().manual_seed(0)
    counters = ExpertCounters()
    weights = [(torch.randn(experts, 2 * inter, hdim, dtype=torch.bfloat16) * 0.02,
                torch.randn(experts, hdim, inter, dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
    costs = measure_costs(weights[0][0], weights[0][1], torch.device("cuda"))
    stores = [OffloadedExperts(DenseStack(gu, dn), torch.device("cuda"), per_layer, counters, costs) for gu, dn in weights]
    resident = [(gu.cuda(), dn.cuda()) for gu, dn in weights]
    steps = 64
    perms = [torch.randperm(experts, generator=gen) for _ in range(layers)]  # hot experts are not the low ids
    routes = [[_zipf_route(batch, experts, top_k, gen, perms[i]) for i in range(layers)] for _ in range(steps)]
    x = torch.randn(batch, hdim, dtype=torch.bfloat16, device="cuda")

    def run(hybrid: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step in routes:
            for i, (w, ids) in enumerate(step):
                w, ids = w.cuda().to(torch.bfloat16), ids.cuda()
                if hybrid:
                    stores[i](x, w, ids)
                else:
                    fused_moe(x, resident[i][0], resident[i][1], w, ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (steps * layers)

    run(False)
    resident_s = run(False)
    run(True)  # warms the cache
    counters.hits = counters.misses = counters.copies = counters.cpu_runs = 0
    hybrid_s = run(True)
    w, ids = routes[-1][0]
    same = (stores[0](x, w.cuda().to(torch.bfloat16), ids.cuda())
            - fused_moe(x, resident[0][0], resident[0][1], w.cuda().to(torch.bfloat16), ids.cuda())).abs().max().item()
    print(f"\nQwen3-30B-A3B expert layer, batch {batch}, {per_layer} of {experts} slots per layer "
          f"(plan on 12 GiB: {plan.cpu_expert_layers} of 48 layers in host memory, {plan.expert_cache_slots} slots): "
          f"resident {resident_s * 1e3:.3f} ms/layer, hybrid {hybrid_s * 1e3:.3f} ms/layer; "
          f"48 layers: {1 / (48 * resident_s):.1f} vs {1 / (48 * hybrid_s):.1f} steps/s; hit rate {counters.hit_rate:.2f}; "
          f"{counters}; costs {costs}; max |diff| {same:.2e}")
    assert same < 5e-2 and plan.fits and plan.cpu_expert_layers > 0


@pytest.mark.parametrize(("routing", "slots"), [("zipf", 16), ("uniform-always-copy", 16), ("uniform-always-copy", 1)])
def test_a_prefill_chunk_streams_the_missing_experts_through_the_cache(routing, slots):
    """zipf: the measured cost model decides; the hot experts' hundreds of tokens make
    a copy cheaper than a CPU run and they stream through the slots, the cold ones run on
    the CPU. uniform-always-copy: every miss streams, to time the waves against their
    copies alone (the compute hidden behind them). One slot: both halves of the waves
    are that slot, so each fill must wait for the compute of the wave before it (a race
    there shows as a wrong output, not as a crash)."""
    hdim, inter, experts, top_k, tokens = 2048, 768, 128, 8, 2048
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(experts, 2 * inter, hdim, dtype=torch.bfloat16, generator=gen) * 0.02
    dn = torch.randn(experts, hdim, inter, dtype=torch.bfloat16, generator=gen) * 0.02
    measured = measure_costs(gu, dn, torch.device("cuda"))
    costs = measured if routing == "zipf" else ALWAYS_COPY
    counters = ExpertCounters()
    store = OffloadedExperts(DenseStack(gu, dn), torch.device("cuda"), slots, counters, costs)
    gu_d, dn_d = gu.cuda(), dn.cuda()
    x = torch.randn(tokens, hdim, dtype=torch.bfloat16, generator=gen).cuda()
    if routing == "zipf":
        w, ids = _zipf_route(tokens, experts, top_k, gen, torch.randperm(experts, generator=gen))
    else:
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
        w = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    w, ids = w.to(torch.bfloat16).cuda(), ids.cuda()

    def timed(fn, reps: int = 5) -> tuple[torch.Tensor, float]:
        # Two warm-up calls: the second step's waves (the cache no longer empty) take
        # block sizes the first did not compile.
        fn()
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            y = fn()
        torch.cuda.synchronize()
        return y, (time.perf_counter() - t0) / reps

    ref, resident_s = timed(lambda: fused_moe(x, gu_d, dn_d, w, ids))
    before = copy.copy(counters)
    got, hybrid_s = timed(lambda: store(x, w, ids))
    err = (got - ref).abs().max().item()
    per_step = {k: (getattr(counters, k) - getattr(before, k)) / 7 for k in ("streamed", "cpu_runs", "hits")}
    # Every miss on the CPU: a step that could not stream (an upper figure: the cached
    # experts run on the CPU too).
    on_cpu = OffloadedExperts(DenseStack(gu, dn), torch.device("cuda"), slots, ExpertCounters(), ALWAYS_CPU)
    _, cpu_s = timed(lambda: on_cpu(x, w, ids), reps=2)
    print(f"\nprefill chunk of {tokens} tokens, {routing} routing, Qwen3-30B-A3B layer shape, {slots} of {experts} "
          f"slots: hybrid {hybrid_s * 1e3:.1f} ms/layer (per step {per_step}; those copies alone "
          f"{per_step['streamed'] * measured.copy_s() * 1e3:.1f} ms at {measured.copy_bytes_per_s / 1e9:.1f} GB/s); "
          f"every expert on the CPU {cpu_s * 1e3:.1f} ms/layer; resident {resident_s * 1e3:.2f} ms/layer; "
          f"max |diff| {err:.2e}; measured {measured}")
    assert per_step["streamed"] > 0 and err <= 1e-2 * ref.abs().max().item() + 1e-3
    if routing != "zipf":
        assert per_step["cpu_runs"] == 0
    assert len(store.slot_of) == slots
