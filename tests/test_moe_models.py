"""Mixture-of-experts decoders against transformers' on tiny random models: Qwen3-MoE
(a dense layer by ``mlp_only_layers``, renormalized top-k), Qwen2-MoE (shared expert and
its gate, a dense layer by ``decoder_sparse_step``), Mixtral (``w1/w2/w3`` expert names)
and OLMoE (q/k norm over the whole projection, ``clip_qkv``). The per-expert checkpoint
tensors are stacked at load; greedy decoding through the engine is in test_engine.py."""

from __future__ import annotations

import pytest
import torch
from model_checks import check_extend_and_decode, check_ragged_batch, pair_fixture

from engine.common.load_errors import WeightMismatch
from engine.layers.moe.sparse_moe import SparseMoeBlock
from engine.loader.load import load_model
from engine.loader.weight_size import weight_bytes
from engine.loader.weights import iter_weights
from engine.models.decoder import MLP

transformers = pytest.importorskip("transformers")

VOCAB = 256
KINDS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]

pair = pair_fixture(KINDS, VOCAB)


def test_config_and_layer_layout_follow_transformers(pair):
    kind, hf, ours, config, _ = pair
    expected = {"qwen3_moe": (8, 2, True, 0), "qwen2_moe": (6, 2, False, 64),
                "mixtral": (4, 2, True, 0), "olmoe": (8, 2, False, 0)}[kind]
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob,
            config.shared_expert_intermediate_size) == expected
    # Which layers are sparse: transformers' own decision, layer by layer.
    hf_sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert config.moe_layers == hf_sparse
    assert config.moe_layers == {"qwen3_moe": (0,), "qwen2_moe": (1,)}.get(kind, (0, 1))
    for i, layer in enumerate(ours.model.layers):
        assert isinstance(layer.mlp, SparseMoeBlock if i in hf_sparse else MLP)
    assert config.qk_norm_whole == (kind == "olmoe") and config.clip_qkv == (1.5 if kind == "olmoe" else None)


def test_experts_are_stacked_from_per_expert_tensors(pair):
    kind, hf, ours, config, path = pair
    names = [n for n, _ in iter_weights(path)]
    assert any(".experts.0." in n for n in names)  # the checkpoint names each expert
    layer = config.moe_layers[0]
    hf_experts = hf.model.layers[layer].mlp.experts
    mlp = ours.model.layers[layer].mlp
    assert torch.equal(mlp.experts.gate_up_proj, hf_experts.gate_up_proj)
    assert torch.equal(mlp.experts.down_proj, hf_experts.down_proj)


def test_prefill_extend_and_decode_match_transformers(pair, paged_runner):
    _, hf, ours, config, _ = pair
    check_extend_and_decode(hf, paged_runner(ours, config), VOCAB)


def test_weight_bytes_counts_every_expert(pair):
    _, hf, ours, config, _ = pair
    held = sum(p.nbytes for p in ours.parameters()) + ours.cos_sin_cache.nbytes
    assert weight_bytes(config, torch.float32) == held
    # transformers' parameters() lists a tied head once, as ours has none.
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_ragged_batch_matches_transformers(pair, paged_runner):
    """Two sequences share each step, so a step routes tokens of both to the experts."""
    _, hf, ours, config, _ = pair
    check_ragged_batch(hf, paged_runner(ours, config), VOCAB)


def test_stacked_checkpoint_names_load_too(pair):
    """A checkpoint saved with transformers 5's stacked names (``mlp.experts.gate_up_proj``)."""
    _, hf, ours, config, _ = pair
    fresh, _ = load_model(pair[4], "cpu", torch.float32)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_weights((n, p.detach()) for n, p in hf.named_parameters())
    for (name, p), (_, q) in zip(ours.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_missing_expert_is_named(tmp_path, make_tiny_hf_model):
    from safetensors.torch import load_file, save_file

    make_tiny_hf_model("mixtral", tmp_path, vocab_size=VOCAB)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightMismatch, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj\[expert 3 up\]"):
        load_model(tmp_path, "cpu", torch.float32)
