"""Gemma 4's text model against transformers' (eager attention) on a tiny random config
whose window (8 tokens) is shorter than the prompts, with what Gemma 4 adds to Gemma 3:
global heads twice the sliding ones' (one KV head whose values are its keys,
proportional RoPE over a quarter of them), two last layers sharing earlier layers' KV
with double-wide MLPs, per-layer embeddings, layer scalars. Logits over the paged KV
cache through prefill, extend and decode; greedy ids through the engine alone, batched,
with chunked prefill and with the prefix cache; what is refused at load."""

from __future__ import annotations

import json

import pytest
import torch
from model_checks import tiny_pair

# Gemma 3's checks, run here on this module's pair: logits over the paged KV cache
# (extend, decode, a ragged batch), greedy ids alone, batched and chunked, after a
# prefix-cache hit, and the C decode layer declining the model.
from test_gemma3 import (  # noqa: F401 - collected here
    test_greedy_ids_equal_transformers_alone_batched_and_chunked,
    test_paged_logits_match_transformers,
    test_prefix_cache_hit_equals_transformers,
    test_the_c_decode_layer_declines_gemma,
)

from engine.common.load_errors import UnsupportedConfig
from engine.loader.weight_size import weight_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 256


@pytest.fixture(scope="module")
def pair(tmp_path_factory, make_tiny_hf_model):
    return tiny_pair("gemma4", tmp_path_factory.mktemp("gemma4"), make_tiny_hf_model, VOCAB)


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
    held = sum(p.nbytes for p in ours.parameters())
    rope = config.max_position_embeddings * 32 * 4 * 2  # float32, both caches at the pool's head size
    assert weight_bytes(config, torch.float32) == held + rope


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
