"""Gemma 4's text model against transformers' (eager attention) on a tiny random config
whose window (8 tokens) is shorter than the prompts, with what Gemma 4 adds to Gemma 3:
global heads twice the sliding ones' (one KV head whose values are its keys,
proportional RoPE over a quarter of them), two last layers sharing earlier layers' KV
with double-wide MLPs, per-layer embeddings, layer scalars; what is refused at load.
Its logits and greedy ids, as every windowed model's, are in ``test_windowed_models.py``."""

from __future__ import annotations

import json

import pytest
import torch
from model_checks import STEPS, VOCAB, check_engine_greedy, pair_fixture

from engine.common.load_errors import UnsupportedConfig
from engine.loader.load import load_model
from engine.loader.weight_size import weight_bytes

transformers = pytest.importorskip("transformers")

pair = pair_fixture(["gemma4"], VOCAB)


def test_config_follows_transformers(pair):
    _, hf, ours, config, _ = pair
    g = config.gemma4
    assert config.architecture == "Gemma4ForCausalLM" and config.layer_types == tuple(hf.config.layer_types)
    assert (g.sliding_head_dim, g.sliding_kv_heads, g.global_head_dim, g.global_kv_heads) == (16, 2, 32, 1)
    assert (config.head_dim, config.num_kv_heads) == (32, 2)  # the pool's: the larger of each
    assert g.keys_as_values and g.double_wide_mlp and (g.kv_shared_layers, g.per_layer_input_size) == (2, 8)
    assert g.global_rotary_fraction == 0.25 and config.attention_scale == 1.0
    # Layers 4 and 5 read the KV of layers 3 and 2, the last of their kinds with KV of their own.
    assert config.kv_layers == (0, 1, 2, 3) and config.kv_windows == (8, 8, 0, 8)
    assert [layer.self_attn.kv_index for layer in ours.model.layers] == [0, 1, 2, 3, 3, 2]
    assert (config.rope.theta, config.rope_local.theta, config.final_logit_softcapping) == (1e6, 1e4, 30.0)
    scalars = sum(1 for n, _ in hf.named_buffers() if n.endswith("layer_scalar"))  # parameters here
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) + scalars
    held = sum(p.nbytes for p in ours.parameters()) + ours.cos_sin_cache.nbytes + ours.cos_sin_local.nbytes
    assert ours.cos_sin_cache.shape == (512, 32) and ours.cos_sin_local.shape == (512, 16)
    assert weight_bytes(config, torch.float32) == held


def test_multimodal_checkpoint_loads_its_language_model(tmp_path, make_tiny_hf_model, caplog):
    """``Gemma4ForConditionalGeneration``: the text config nested, the language model's
    tensors under ``model.language_model``, the vision tower and its embedder skipped."""
    text = make_tiny_hf_model("gemma4", None, vocab_size=VOCAB)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    full = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.config.to_dict(), vision_config=vision, audio_config=None)).eval()
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.save_pretrained(tmp_path)
    with caplog.at_level("INFO", logger="headroom.engine"):
        _, config = load_model(tmp_path, "cpu", torch.float32)
    assert config.architecture == "Gemma4ForConditionalGeneration" and config.gemma4.kv_shared_layers == 2
    assert "vision and audio tensors of the checkpoint skipped" in caplog.text
    check_engine_greedy(text, tmp_path, VOCAB, STEPS, 22)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("enable_moe_block", True, "mixture-of-experts block"),
    ("use_bidirectional_attention", "all", "bidirectional attention"),
    ("vocab_size_per_layer_input", 128, "per-layer embeddings over 128 tokens"),
])
def test_what_is_not_run_is_refused_at_load_naming_it(pair, tmp_path, field, value, named):
    from engine.loader.hf_config import load_model_config

    raw = json.loads((pair[4] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, field: value, "num_experts": 4, "top_k_experts": 2,
                                                      "moe_intermediate_size": 16}))
    with pytest.raises(UnsupportedConfig, match=named):
        load_model_config(tmp_path)


def _e2b_config() -> dict:
    """google/gemma-4-E2B-it's config.json as published (its text part; transformers fills
    the RoPE of both kinds with Gemma 4's defaults)."""
    kinds = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    text = {"model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
            "num_global_key_value_heads": None, "attention_k_eq_v": False, "sliding_window": 512,
            "vocab_size": 262144, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
            "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
            "layer_types": kinds, "tie_word_embeddings": True}
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "eos_token_id": [1, 106],
            "text_config": text, "vision_config": None, "audio_config": None, "tie_word_embeddings": True}


def test_gemma4_e2b_config_and_its_kv_price(tmp_path):
    """The E2B's 35 layers, of which the first 15 hold KV (12 sliding over 512 tokens, 3
    global), priced at the pool's one shape: heads of 512, one KV head."""
    from engine.core.footprint import kv_bytes_per_token, make_footprint
    from engine.loader.hf_config import load_model_config
    from engine.memory.device import simulated_device
    from engine.memory.ledger import make_plan
    from engine.memory.plan import GiB, PlanKnobs

    (tmp_path / "config.json").write_text(json.dumps(_e2b_config()))
    mc = load_model_config(tmp_path)
    g = mc.gemma4
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (35, 8, 1, 512)
    assert (g.sliding_head_dim, g.global_head_dim, g.global_kv_heads, g.per_layer_input_size) == (256, 512, 1, 256)
    assert mc.kv_layers == tuple(range(15)) and mc.kv_windows == (512, 512, 512, 512, 0) * 3
    assert g.global_rotary_fraction == 0.25 and mc.rope.theta == 1e6 and mc.rope_local.theta == 1e4
    assert mc.eos_token_ids[:2] == (1, 106) and mc.tie_word_embeddings and not g.keys_as_values
    assert kv_bytes_per_token(mc, torch.bfloat16) == 15 * 2 * 512 * 2
    # The plan: its weights (the per-layer embeddings' 2.3 billion among them) and its pool
    # of every layer (the sliding layers' rings: tests/test_sliding_kv_ring.py).
    knobs = PlanKnobs(max_running_requests=4, sliding_kv_ring="off")
    footprint = make_footprint(mc, torch.bfloat16, knobs)
    plan = make_plan(simulated_device(24 * GiB), knobs, footprint)
    assert footprint.weight_bytes > 2 * (262144 * 35 * 256) and plan.num_pages > 1
    line = {e.name: e for e in plan.ledger}["KV cache pool"]
    assert line.bytes == plan.num_pages * knobs.page_size * 15 * 2 * 512 * 2
