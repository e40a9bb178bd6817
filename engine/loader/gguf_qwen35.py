"""llama.cpp's Qwen3.5 / Qwen3.6 GGUF layout (``qwen35``, ``qwen35moe``) read back as
transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``: the config from the
``ssm.*`` keys and the tensor table, the tensors with llama.cpp's conversion
(``convert_hf_to_gguf.py``'s ``Qwen3NextModel`` and ``_LinearAttentionVReorderBase``)
undone.

llama.cpp stores, per linear-attention layer: ``attn_qkv`` (``in_proj_qkv``), ``attn_gate``
(``in_proj_z``), ``ssm_beta`` / ``ssm_alpha`` (``in_proj_b`` / ``in_proj_a``), ``ssm_a``
(``-exp(A_log)``, named without a suffix), ``ssm_dt.bias`` (``dt_bias``), ``ssm_conv1d`` (the conv kernel squeezed
to ``[C, K]``), ``ssm_norm`` and ``ssm_out``; where a key head serves several value heads
it reorders the value heads from grouped by key head (``k0v0, k0v1, k1v0, k1v1``) to
tiled (``k0v0, k1v0, k0v1, k1v1``) in every tensor indexed by them. Its zero-centred
RMSNorm weights (``attn_norm``, ``post_attention_norm``, ``attn_q_norm``, ``attn_k_norm``,
``output_norm``; not ``ssm_norm``) are stored as the scale ``1 + w``. Its files may carry
the multi-token-prediction layers after the model's own (``nextn_predict_layers`` of the
``block_count``); they are not read.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}

# A layer's GGUF stem -> transformers' name under ``model.layers.N.``.
_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm.weight",
    "attn_qkv": "linear_attn.in_proj_qkv.weight",
    "attn_gate": "linear_attn.in_proj_z.weight",
    "ssm_beta": "linear_attn.in_proj_b.weight",
    "ssm_alpha": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d.weight",
    "ssm_norm": "linear_attn.norm.weight",
    "ssm_out": "linear_attn.out_proj.weight",
}

# Norms stored as their scale ``1 + w``.
_SCALE_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")


def hybrid_config(get, field, names: set[str], config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5 fields of ``config.json`` from the GGUF metadata.

    Args:
        get: ``get(key, default=None)`` reads ``<arch>.<key>``, raising where it is absent
            and has no default. field: ``field(key)`` reads a whole key, None if absent.
        names: the file's tensor names: a layer with ``attn_q`` is full attention.
        config: the fields read so far (``head_dim``, ``rope_theta``, ``num_hidden_layers``:
            the block count, multi-token-prediction layers included).
    """
    value_heads = int(get("ssm.time_step_rank"))
    layers = config["num_hidden_layers"] - int(get("nextn_predict_layers", 0))
    rotary = int(get("rope.dimension_count", config["head_dim"]))
    sections = list(get("rope.dimension_sections", [])) or [11, 11, 10]
    return {
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if f"blk.{i}.attn_q.weight" in names else "linear_attention"
                        for i in range(layers)],
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"],
                            "partial_rotary_factor": rotary / config["head_dim"],
                            "mrope_section": [int(s) for s in sections[:3]], "mrope_interleaved": True},
    }


def grouped_rows(data: torch.Tensor, stem: str, config: Any) -> torch.Tensor:
    """A linear-attention projection's rows (of weights, or of blocks: a row of blocks is
    a row of weights) with the value heads back in grouped order; other tensors, and
    ``ssm_out`` (whose value heads are its columns: the layer tiles its input instead,
    ``GatedDeltaNet.out_proj_tiled``), as they are. ``config``: a
    :class:`~engine.common.config.ModelConfig`."""
    kind = stem.rpartition(".")[2]
    if kind not in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"):
        return data
    dims = {"linear_num_key_heads": config.linear_num_key_heads, "linear_num_value_heads": config.linear_num_value_heads,
            "linear_key_head_dim": config.linear_key_head_dim, "linear_value_head_dim": config.linear_value_head_dim}
    return _untiled(kind, data, dims)


def prediction_layer_tensor(gguf_name: str, config: dict[str, Any]) -> bool:
    """Whether ``gguf_name`` belongs to a multi-token-prediction layer (a block past the
    model's ``num_hidden_layers``), which the model does not read."""
    parts = gguf_name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= config["num_hidden_layers"]


def hybrid_tensor(gguf_name: str, hf_name: str | None, w: torch.Tensor,
                  config: dict[str, Any]) -> tuple[str | None, torch.Tensor]:
    """One dequantized GGUF tensor (``w`` in transformers' ``[rows, cols]`` order) as
    transformers' tensor: ``(name, tensor)``; ``hf_name`` is the name the shared mapping
    gave it (None for the linear-attention stems, named here)."""
    stem = gguf_name.removesuffix(".weight").removesuffix(".bias")  # ssm_a has no suffix
    parts = stem.split(".")
    kind = parts[-1]
    if kind in _SCALE_NORMS:
        w = w - 1.0
    if len(parts) == 3 and kind in _LAYER_NAMES:
        hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[kind]}"
        w = _untiled(kind, w, config)
    return hf_name, w


def _untiled(kind: str, w: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """A linear-attention tensor with its value heads back in transformers' grouped order
    (and ``A_log``, the conv kernel's ``[C, 1, K]`` shape)."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]

    def grouped(t: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        if hk == hv:
            return t
        shape = list(t.shape)
        tiled = t.reshape(*shape[:dim], hv // hk, hk, head, *shape[dim + 1:])
        return tiled.transpose(dim, dim + 1).reshape(shape)

    if kind in ("attn_qkv", "ssm_conv1d"):
        qk = 2 * hk * dk
        w = torch.cat([w[:qk], grouped(w[qk:], 0, dv)])
        return w.unsqueeze(1) if kind == "ssm_conv1d" else w
    if kind == "attn_gate":
        return grouped(w, 0, dv)
    if kind in ("ssm_beta", "ssm_alpha"):
        return grouped(w, 0, 1)
    if kind == "ssm_a":
        return torch.log(-grouped(w, 0, 1))
    if kind == "ssm_dt":
        return grouped(w, 0, 1)
    if kind == "ssm_out":
        return grouped(w, 1, dv)
    return w
