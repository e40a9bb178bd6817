"""GGUF tensors as the Hugging Face tensors they stand for: llama.cpp's names mapped to
transformers', a stacked expert tensor split one tensor per expert, llama.cpp's q/k row
permutation undone, values dequantized to float32 through gguf-py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.common.load_errors import ModelLoadError
from engine.loader.gguf_config import LLAMA_WITH_EXPERTS
from engine.loader.gguf_gpt_oss import ARCHITECTURES as GPT_OSS_ARCHITECTURES
from engine.loader.gguf_gpt_oss import checkpoint_tensors
from engine.loader.gguf_qwen35 import ARCHITECTURES as QWEN35_ARCHITECTURES
from engine.loader.gguf_qwen35 import hybrid_tensor, prediction_layer_tensor

# llama.cpp tensor names (gguf-py ``tensor_mapping``) -> Hugging Face names.
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts (gguf-py's MODEL_TENSOR.FFN_*_EXP / *_SHEXP names).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


# A layer's experts stacked in one GGUF tensor ``[E, rows, cols]`` -> one Hugging Face
# tensor per expert, ``mlp.experts.E.<proj>`` (Mixtral: ``block_sparse_moe.experts.E.w1``).
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                    "ffn_gate_up_exps": "gate_up_proj"}  # gate and up in one [E, 2I, H] (Qwen3.5-MoE)


_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


# Gemma 3's four norms a layer: llama.cpp's ``ffn_norm`` is the one before the MLP there.
_GEMMA3_PER_LAYER = {
    **_PER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _hf_name(gguf_name: str, gguf_arch: str = "") -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    parts = stem.split(".")
    per_layer = _GEMMA3_PER_LAYER if gguf_arch == "gemma3" else _PER_LAYER
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{suffix}"
    return None


def reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in
    ``convert_hf_to_gguf.py``), which turns transformers' "rotate_half" RoPE layout into
    GGML's interleaved one; this is transformers' ``_reverse_permute_weights``.

    Args:
        w: ``[n_head * head_dim, ...]`` q or k weight (or bias) as stored in the GGUF.
        n_head: query heads for q, key/value heads for k.

    Returns:
        The tensor in Hugging Face row order, same shape.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """``[rows, cols]`` (or ``[n]``) float32 values of a GGUF tensor in Hugging Face order.

    Values that are NaN or infinite (a corrupt block: a scale of inf) are kept without
    numpy's RuntimeWarnings: the file's check says so in one line
    (:func:`engine.loader.gguf_config.read_checked`), and a request the model answers
    with such logits fails with ``invalid_logits``."""
    from gguf import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    with np.errstate(all="ignore"):
        return dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def converted_tensors(
    tensors: Iterable[Any], gguf_path: Path, gguf_arch: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """A GGUF's tensors, in the file's order, as the Hugging Face checkpoint's
    (:func:`hf_tensors` one by one; a gpt-oss file's as a whole, its gate and up experts
    paired: :func:`engine.loader.gguf_gpt_oss.checkpoint_tensors`), in ``dtype``.

    Raises:
        ModelLoadError: a tensor without a Hugging Face counterpart.
    """
    if gguf_arch not in GPT_OSS_ARCHITECTURES:
        for t in tensors:
            yield from hf_tensors(t, gguf_path, gguf_arch, config, dtype)
        return
    dense = ((t.name, torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32))) for t in tensors)
    try:
        for name, w in checkpoint_tensors(dense):
            yield name, w.to(dtype).contiguous()
    except ModelLoadError as e:
        raise ModelLoadError(f"{gguf_path}: {e}") from None


def hf_tensors(
    t: Any, gguf_path: Path, gguf_arch: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """One GGUF tensor, dequantized, as the Hugging Face tensors it stands for (one per
    expert for a stacked expert tensor), under their names; none for a Qwen3.5 file's
    multi-token-prediction layer.

    Args:
        config: config.json's fields (``architectures``, ``num_attention_heads``,
            ``num_key_value_heads`` are read).

    Raises:
        ModelLoadError: the tensor has no Hugging Face counterpart.
    """
    if gguf_arch in QWEN35_ARCHITECTURES and prediction_layer_tensor(t.name, config):
        return  # the multi-token-prediction layer: not run
    stem, _, _ = t.name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _STACKED_EXPERTS:
        yield from _expert_tensors(t, parts[1], _STACKED_EXPERTS[parts[2]], config, dtype)
        return
    name, w = _hf_name(t.name, gguf_arch), None
    if gguf_arch in QWEN35_ARCHITECTURES:  # linear-attention layers, norms stored as 1 + w
        name, w = hybrid_tensor(t.name, name, torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32)),
                                config)
    if name is None:
        raise ModelLoadError(
            f"{gguf_path}: tensor {t.name} has no Hugging Face counterpart for a "
            f"{gguf_arch} model; the file is not a plain {gguf_arch} checkpoint"
        )
    if w is None:
        w = torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32))
    if name.endswith("shared_expert_gate.weight"):  # llama.cpp may store it as [H]
        w = w.reshape(1, -1)
    if config["architectures"] == [LLAMA_WITH_EXPERTS[0]] and ".mlp.gate." in name:
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if gguf_arch == "gemma3" and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stores Gemma's norms as the 1 + w they scale by
    if gguf_arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        w = reverse_llama_permute(w, heads)
    yield name, w.to(dtype).contiguous()


def _expert_tensors(
    tensor: Any, layer: str, proj: str, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked ``[E, rows, cols]`` GGUF expert tensor, dequantized, as one Hugging
    Face tensor per expert."""
    w = torch.from_numpy(np.array(dequantize_tensor(tensor), dtype=np.float32)).to(dtype)
    if config["architectures"] == [LLAMA_WITH_EXPERTS[0]]:
        prefix, proj = f"model.layers.{layer}.block_sparse_moe.experts", _MIXTRAL_EXPERT_NAMES[proj]
        names = [f"{prefix}.{e}.{proj}.weight" for e in range(w.shape[0])]
    elif proj == "gate_up_proj":  # one [E, 2I, H] tensor: gate rows, then up rows
        yield f"model.layers.{layer}.mlp.experts.gate_up_proj", w.contiguous()
        return
    else:
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(w.shape[0])]
    for name, expert in zip(names, w, strict=True):
        yield name, expert.contiguous()
