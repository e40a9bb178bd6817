"""Hybrid linear-attention models on CUDA: the engine's Gated DeltaNet layers in
flash-linear-attention's kernels (``chunk_gated_delta_rule`` for prefill,
``fused_recurrent_gated_delta_rule`` for decode) against transformers' torch path on the
same card, tiny random-weight Qwen3-Next configs (dense and MoE).

float32: greedy ids must agree for 32 steps; the kernels' chunked sums differ from the
token-by-token reference in the last bits, so a late divergence on a near-tie of random
weights is allowed after 16 steps.
"""

from __future__ import annotations

import pytest
from model_checks import cuda_engine_agreement

pytest.importorskip("fla")
STEPS = 32


@pytest.mark.parametrize("kind", ["qwen3_next_dense", "qwen3_next"])
def test_hybrid_engine_on_cuda_uses_fla_and_matches_transformers(kind, tmp_path, make_tiny_hf_model, monkeypatch):
    hf = make_tiny_hf_model(kind, tmp_path, vocab_size=512).cuda()
    import engine.layers.gated_deltanet as gdn

    calls = {"fla": 0}
    real = gdn.GatedDeltaNet._fla

    def counting(self, *args, **kwargs):
        calls["fla"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gdn.GatedDeltaNet, "_fla", counting)
    runs = cuda_engine_agreement(tmp_path, hf, STEPS)
    assert calls["fla"] > 0, "the fla kernels were not used on CUDA"
    for i, (ids, ours, agree) in enumerate(runs):
        print(f"{kind} prompt {len(ids)}: {agree}/{STEPS} greedy ids equal")
        assert agree >= 16, (kind, i, ours)


@pytest.mark.parametrize("chunk", [2048, 8192])
def test_plan_prices_the_linear_attention_transient_within_3_percent(chunk, tmp_path):
    """One Gated DeltaNet layer of Qwen3-Next-80B-A3B's dimensions, bfloat16, in fla's
    chunked kernel: the plan's estimate against the allocator's measured peak."""
    from engine.bench.hybrid import layer_transient
    from engine.bench.model_shapes import write_shape
    from engine.core.footprint import linear_attention_activation_bytes
    from engine.loader.hf_config import load_model_config

    mc = load_model_config(write_shape("qwen3-next-80b-a3b", tmp_path, num_hidden_layers=4, num_experts=8,
                                         num_experts_per_tok=2))
    measured = layer_transient(mc, chunk)
    estimate = linear_attention_activation_bytes(mc, chunk, 2)
    print(f"chunk {chunk}: measured {measured / 2**20:.1f} MiB, plan {estimate / 2**20:.1f} MiB")
    assert abs(estimate - measured) <= 0.03 * measured
