"""Parts of conftest's tiny transformers models: the Qwen3.5 configs, a gpt-oss
reference made to apply its config's SwiGLU clamp under older transformers, and a small
Qwen3.6-35B-A3B-like engine config."""

from __future__ import annotations


def tiny_qwen3_5_config(kind: str, common: dict, moe: dict):
    """Qwen3.5 (``"qwen3_5"``), its MoE (``"qwen3_5_moe"``, every layer routed, a shared
    expert) and their vision-language checkpoints (``..._vl``, a one-block vision tower):
    layers linear, full, linear, full; 2 key heads serving 4 value heads of 32 (a Q8_0
    block: reordering value heads moves whole blocks); multimodal RoPE sections over a
    partial rotary of 8 of 16 dims."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = dict(**common, head_dim=16, rope_parameters=rope,
                layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                linear_conv_kernel_dim=4)
    is_moe = kind.startswith("qwen3_5_moe")
    if is_moe:
        del text["intermediate_size"]
        text.update(moe, num_experts=6, shared_expert_intermediate_size=48)
    if not kind.endswith("_vl"):
        return (transformers.Qwen3_5MoeTextConfig if is_moe else transformers.Qwen3_5TextConfig)(**text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  out_hidden_size=common["hidden_size"], num_position_embeddings=16)
    outer = transformers.Qwen3_5MoeConfig if is_moe else transformers.Qwen3_5Config
    return outer(text_config=text, vision_config=vision, tie_word_embeddings=False)


def clamp_as_configured(model) -> None:
    """Make a gpt-oss reference apply its config's SwiGLU clamp: transformers before 5.2x
    fix every expert module's ``alpha`` and ``limit`` at 1.702 and 7.0 (gpt-oss's
    published values) and ignore the config's ``swiglu_limit``, which the engine reads
    and the tiny config sets to 0.5 so that the clamp bites. Newer releases read it."""
    config = model.config
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha") and hasattr(module, "gate_up_proj"):
            module.alpha = float(getattr(config, "swiglu_alpha", module.alpha))
            module.limit = float(getattr(config, "swiglu_limit", module.limit))


def tiny_qwen36_config(folder, **overrides):
    """The engine's ModelConfig of Qwen3.6-35B-A3B's shape cut small (256 wide, 4 layers,
    2 key heads serving 4 value heads of 64, 4 experts of 256, top 2), ``overrides`` on
    top, its config.json written under ``folder``."""
    from engine.bench.model_shapes import write_shape
    from engine.loader.hf_config import load_model_config

    small = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
                 num_experts_per_tok=2, max_position_embeddings=64)
    return load_model_config(write_shape("qwen3.6-35b-a3b", folder, **{**small, **overrides}))
