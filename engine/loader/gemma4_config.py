"""Gemma 4's text config (``Gemma4TextConfig``, transformers' reading of it) as the
fields of :class:`~engine.common.config.ModelConfig` it sets, with what headroom does
not run of it refused before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.common.config import RopeConfig
from engine.common.gemma4_layout import Gemma4Layout
from engine.common.load_errors import UnsupportedConfig

MODEL_TYPE = "gemma4_text"
_SLIDING, _GLOBAL = "sliding_attention", "full_attention"


def is_gemma4(hf: Any) -> bool:
    return getattr(hf, "model_type", "") == MODEL_TYPE


def _heads(hf: Any, kind: str) -> tuple[int, int]:
    """``(head_dim, num_kv_heads)`` of the layers of ``kind`` (transformers' per-layer
    config: the global layers' ``global_head_dim`` and ``num_global_key_value_heads``)."""
    layer = hf.layer_types.index(kind) if kind in hf.layer_types else 0
    view = hf.per_layer_config[layer]
    return int(view.head_dim), int(view.num_key_value_heads)


def _rope(params: dict[str, Any], config_path: Path) -> tuple[RopeConfig, float]:
    """One layer kind's RoPE and the share of its frequencies that turn."""
    kind = params.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise UnsupportedConfig(f"{config_path}: Gemma 4 with RoPE type {kind!r} is not supported; "
                                "headroom implements default and proportional")
    factor = float(params.get("factor", 1.0))
    rope = RopeConfig(theta=float(params["rope_theta"]), rope_type="linear" if factor != 1.0 else "default",
                      factor=factor)
    return rope, float(params.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0


def gemma4_fields(hf: Any, config_path: Path) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a Gemma 4 text config (``{}`` for other
    models): the KV pool's shape (the larger heads of the two layer kinds), both kinds'
    RoPE, the attention scale (1), the logits' soft-cap and :class:`Gemma4Layout`.

    Raises:
        UnsupportedConfig: what headroom does not run yet, named: the mixture-of-experts
            block (``enable_moe_block``), bidirectional attention, per-layer embeddings
            over a vocabulary other than the model's, a KV head count that does not
            divide the pool's, sliding RoPE that is not plain.
    """
    if not is_gemma4(hf):
        return {}
    if getattr(hf, "enable_moe_block", False):
        raise UnsupportedConfig(
            f"{config_path}: Gemma 4's mixture-of-experts block (enable_moe_block: a dense MLP beside "
            "routed experts in every layer, as in gemma-4-26B-A4B) is not supported yet; the dense Gemma 4 "
            "models run")
    if getattr(hf, "use_bidirectional_attention", None) == "all":
        raise UnsupportedConfig(f"{config_path}: bidirectional attention (an encoder) is not supported")
    per_layer = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
    if per_layer and int(hf.vocab_size_per_layer_input) != int(hf.vocab_size):
        raise UnsupportedConfig(
            f"{config_path}: per-layer embeddings over {hf.vocab_size_per_layer_input} tokens of a "
            f"{hf.vocab_size}-token vocabulary are not supported")
    (sliding_dim, sliding_kv), (global_dim, global_kv) = _heads(hf, _SLIDING), _heads(hf, _GLOBAL)
    pool_kv = max(sliding_kv, global_kv)
    if pool_kv % sliding_kv or pool_kv % global_kv:
        raise UnsupportedConfig(f"{config_path}: Gemma 4 with {sliding_kv} sliding and {global_kv} global KV "
                                "heads (neither a multiple of the other) is not supported")
    local, _ = _rope(hf.rope_parameters[_SLIDING], config_path)
    rope, fraction = _rope(hf.rope_parameters[_GLOBAL], config_path)
    if _rope(hf.rope_parameters[_SLIDING], config_path)[1] != 1.0:
        raise UnsupportedConfig(f"{config_path}: Gemma 4 with proportional RoPE on its sliding layers is not supported")
    layout = Gemma4Layout(
        sliding_head_dim=sliding_dim, sliding_kv_heads=sliding_kv, global_head_dim=global_dim,
        global_kv_heads=global_kv, global_rotary_fraction=fraction,
        kv_shared_layers=int(getattr(hf, "num_kv_shared_layers", 0) or 0),
        keys_as_values=bool(getattr(hf, "attention_k_eq_v", False)), per_layer_input_size=per_layer,
        double_wide_mlp=bool(getattr(hf, "use_double_wide_mlp", False)),
    )
    return {
        "head_dim": max(sliding_dim, global_dim),
        "num_kv_heads": pool_kv,
        "rope": rope,
        "rope_local": local,
        "layer_types": tuple(hf.layer_types),
        "sliding_window": int(hf.sliding_window or 0),
        "query_pre_attn_scalar": 1.0,  # the scale is 1: q and k are normed per head
        "final_logit_softcapping": float(hf.final_logit_softcapping or 0),
        "hidden_act": hf.hidden_activation,
        "gemma4": layout,
    }
