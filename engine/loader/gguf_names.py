"""The GGUF tensors a model of a config needs, by llama.cpp's names: the one list the
block loader (:mod:`engine.loader.gguf_quant`) fills the model from and the check before
a load (:func:`check_gguf_tensors`) reads a file's tensor table against.

Torch-free: ``headroom serve`` checks a file with it before its worker starts.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from engine.common.config import ModelConfig
from engine.common.load_errors import WeightMismatch

# Our fused module (under model.layers.N) -> the GGUF tensors stacked in it, in order.
ATTENTION_TARGETS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
}
# A linear-attention layer's fused modules (Qwen3.5's, :mod:`engine.loader.gguf_qwen35`).
LINEAR_TARGETS = {
    "linear_attn.in_proj_qkvz": ("attn_qkv", "attn_gate"),
    "linear_attn.in_proj_ba": ("ssm_beta", "ssm_alpha"),
    "linear_attn.out_proj": ("ssm_out",),
}
LAYER_TARGETS = {
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
SHARED_EXPERT_TARGETS = {
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
    "mlp.shared_expert.down_proj": ("ffn_down_shexp",),
}
# A layer's routed experts, stacked (gguf-py's FFN_GATE_EXP, FFN_UP_EXP, FFN_DOWN_EXP).
EXPERT_STEMS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# The token embeddings.
EMBEDDINGS = "token_embd.weight"


def projection_targets(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Module name -> GGUF tensor stems, for every projection of ``config`` (a mixture of
    experts' layers: their shared expert's, when they have one; a hybrid's
    linear-attention layers: their in- and out-projections)."""
    out = {}
    for i in range(config.num_layers):
        mlp = LAYER_TARGETS
        if config.is_moe and i in config.moe_layers:
            mlp = SHARED_EXPERT_TARGETS if config.shared_expert_intermediate_size else {}
        linear = config.is_hybrid and config.layer_types[i] == "linear_attention"
        for module, stems in {**(LINEAR_TARGETS if linear else ATTENTION_TARGETS), **mlp}.items():
            out[f"model.layers.{i}.{module}"] = tuple(f"blk.{i}.{stem}" for stem in stems)
    if not config.tie_word_embeddings:
        out["lm_head"] = ("output",)
    return out


def expert_targets(config: ModelConfig) -> dict[str, tuple[str, str, str]]:
    """``model.layers.N.mlp.experts`` -> its gate, up and down GGUF tensor names."""
    if not config.is_moe:
        return {}
    return {f"model.layers.{i}.mlp.experts": tuple(f"blk.{i}.{stem}.weight" for stem in EXPERT_STEMS)
            for i in config.moe_layers}


def check_gguf_tensors(config: ModelConfig, gguf_path: str | Path, names: Collection[str]) -> None:
    """Refuse a GGUF whose tensor table (``names``, its tensors' names) lacks a tensor
    the model of ``config`` is built from: the token embeddings, every projection's weight,
    every MoE layer's stacked experts (gate and up as one ``ffn_gate_up_exps`` too). A
    vocab-only file (metadata and tokenizer, no tensors, as llama.cpp's
    ``ggml-vocab-*.gguf``) is refused as such. Reads no tensor data.

    Raises:
        WeightMismatch: ``"<gguf_path>: the file holds no tensors (a vocabulary-only
            GGUF)..."`` for an empty table, else ``"<gguf_path>: tensor <name> is
            missing"``, the first missing.
    """
    if not names:
        raise WeightMismatch(f"{gguf_path}: the file holds no tensors (a vocabulary-only GGUF); "
                             "download the model's GGUF with its weights")
    wanted = [f"{s}.weight" for stems in projection_targets(config).values() for s in stems]
    for experts in expert_targets(config).values():
        if experts[0].replace("ffn_gate_exps", "ffn_gate_up_exps") in names:
            experts = experts[2:]
        wanted.extend(experts)
    wanted.append(EMBEDDINGS)
    for name in wanted:
        if name not in names:
            raise WeightMismatch(f"{gguf_path}: tensor {name} is missing")
