"""Gemma 3's text model against transformers' (eager attention) on tiny random configs
whose window (8 tokens) is shorter than the prompts: its config, the backends' window
and score cap, the language model of a multimodal checkpoint, and the plan's price of
the sliding layers' KV. The logits and greedy ids every windowed model checks are in
``test_windowed_models.py``."""

from __future__ import annotations

import pytest
import torch
from model_checks import STEPS, VOCAB, check_attention_step, check_engine_greedy, pair_fixture

from engine.core.footprint import kv_bytes_per_token, make_footprint, windowed_kv_bytes
from engine.loader.load import load_model
from engine.loader.weight_size import weight_bytes
from engine.memory.plan import PlanKnobs

transformers = pytest.importorskip("transformers")

pair = pair_fixture(["gemma3", "gemma3_capped"], VOCAB)


def test_config_follows_transformers(pair):
    kind, hf, ours, config, _ = pair
    assert config.layer_types == tuple(hf.config.layer_types)
    assert config.kv_windows == (8, 8, 0, 8, 8, 0)
    assert config.attention_scale == 32**-0.5
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1e6, "linear", 8.0)
    assert (config.rope_local.theta, config.rope_local.rope_type) == (1e4, "default")
    assert config.final_logit_softcapping == (3.0 if kind == "gemma3_capped" else 0.0)
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    held = sum(p.nbytes for p in ours.parameters()) + ours.cos_sin_cache.nbytes + ours.cos_sin_local.nbytes
    assert weight_bytes(config, torch.float32) == held


def test_multimodal_checkpoint_loads_its_language_model(tmp_path, make_tiny_hf_model, caplog):
    """``Gemma3ForConditionalGeneration``: the text config nested, the language model's
    tensors under ``model.language_model``, the vision tower skipped."""
    text = make_tiny_hf_model("gemma3", None, vocab_size=VOCAB)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    full = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4)).eval()
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.save_pretrained(tmp_path)
    with caplog.at_level("INFO", logger="headroom.engine"):
        _, config = load_model(tmp_path, "cpu", torch.float32)
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.kv_windows == (8, 8, 0, 8, 8, 0)
    assert "vision tensors of the checkpoint skipped" in caplog.text
    check_engine_greedy(text, tmp_path, VOCAB, STEPS, 22)


def test_sliding_layers_kv_is_priced_at_their_window(pair):
    """With ``--sliding-kv-ring off`` the pool keeps every layer's tokens (a page holds
    all layers), so the per-token price is all six layers'; what the sliding layers
    need is their window (the default's rings: tests/test_sliding_kv_ring.py)."""
    _, _, _, config, _ = pair
    per_layer = 2 * config.num_kv_heads * config.head_dim * 4  # float32 keys and values
    assert kv_bytes_per_token(config, torch.float32) == 6 * per_layer
    # 100 tokens: the 2 global layers hold 100, the 4 sliding ones their window of 8.
    assert windowed_kv_bytes(config, torch.float32, 100) == (2 * 100 + 4 * 8) * per_layer
    assert windowed_kv_bytes(config, torch.float32, 5) == 6 * 5 * per_layer
    fp = make_footprint(config, torch.float32, PlanKnobs(sliding_kv_ring="off"))
    assert fp.kv_bytes_per_token == 6 * per_layer
    assert fp.kv_window_note.startswith("4 of 6 layers slide over 8 tokens")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_window_and_softcap_equal_eager_attention(backend):
    """The backend's sliding window and score cap against transformers' eager attention
    (the function Gemma's layers call), a layer of window 5 and a global one (Triton's
    kernels under its interpreter)."""
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim = 2, 8

    def eager(q, k, v, mask, scale):
        return eager_attention_forward(module, q, k, v, mask, scaling=scale, softcap=1.5)[0]

    check_attention_step((5, 0), eager, softcap=1.5, backend=backend)


# google/gemma-3-4b-it's published config.json (its text_config as sparse as it is there:
# transformers fills the rest with Gemma 3's defaults).
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
    "initializer_range": 0.02, "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_gemma3_4b_config_and_its_plan_line(tmp_path):
    """The 4B's 34 layers, 29 sliding over 1,024 tokens, read from its published config;
    with ``--sliding-kv-ring off`` the plan prices every layer per token and says what the
    window alone takes."""
    import json

    from engine.loader.hf_config import load_model_config
    from engine.memory.device import simulated_device
    from engine.memory.ledger import make_plan
    from engine.memory.plan import GiB

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B))
    mc = load_model_config(tmp_path)
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (34, 8, 4, 256, 262208)
    assert [i for i, w in enumerate(mc.kv_windows) if not w] == [5, 11, 17, 23, 29]
    assert mc.attention_scale == 256**-0.5 and mc.rope.factor == 8.0 and mc.rope_local.theta == 10_000.0
    assert mc.eos_token_ids[:2] == (1, 106) and mc.tie_word_embeddings
    knobs = PlanKnobs(max_running_requests=4, sliding_kv_ring="off")
    plan = make_plan(simulated_device(24 * GiB), knobs, make_footprint(mc, torch.bfloat16, knobs))
    line = {e.name: e for e in plan.ledger}["KV cache pool"]
    per_layer = 2 * 4 * 256 * 2  # bfloat16 keys and values of one token
    assert line.bytes == plan.num_pages * knobs.page_size * 34 * per_layer
    assert f"29 of 34 layers slide over 1,024 tokens and are priced per token like the others " \
           f"(their window alone: {1024 * 29 * per_layer:,} bytes per request)" in line.source


def test_windowed_models_get_a_backend_with_windows():
    """Sliding windows and soft-capped scores are in the torch and Triton backends (auto
    picks Triton on CUDA), not FlashInfer's; a backend without windows refuses them."""
    from engine.layers.attention.registry import backend_class, resolve_backend_name

    assert resolve_backend_name("auto", "cuda", windows=True) == "triton"
    assert resolve_backend_name("auto", "cuda", windows=True, softcap=True) == "triton"
    assert resolve_backend_name("triton", "cuda", softcap=True) == "triton"
    with pytest.raises(ValueError, match="has no soft-capped attention"):
        resolve_backend_name("flashinfer", "cuda", softcap=True)
    with pytest.raises(ValueError, match="has no sliding-window attention"):
        resolve_backend_name("flashinfer", "cuda", windows=True)
    windowless = backend_class("flashinfer").__new__(backend_class("flashinfer"))  # no CUDA needed to ask
    with pytest.raises(ValueError, match="--attention-backend torch"):
        windowless.use_windows((8,))
    windowless.use_windows((0,))  # no window: nothing to refuse
    assert windowless.windows == () and windowless.softcap == 0.0
