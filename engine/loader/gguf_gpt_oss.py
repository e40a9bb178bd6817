"""llama.cpp's gpt-oss GGUF layout (``gpt-oss``) read back as transformers'
``GptOssForCausalLM`` checkpoint, llama.cpp's conversion (``conversion/gpt_oss.py``)
undone.

llama.cpp stores, per layer: ``attn_norm`` and ``post_attention_norm`` (the norms before
the attention and before the MLP), ``attn_q``/``attn_k``/``attn_v``/``attn_output`` with
their biases (no row permutation), ``attn_sinks.weight`` (the checkpoint's
``self_attn.sinks``), ``ffn_gate_inp`` (the router, with its bias), and the experts split
and transposed: the checkpoint's ``gate_up_proj`` ``[E, H, 2I]`` (gate and up columns
interleaved, gate the even ones) as ``ffn_gate_exps`` and ``ffn_up_exps`` ``[E, I, H]``,
its bias ``[E, 2I]`` as their two ``[E, I]`` biases, ``down_proj`` ``[E, I, H]`` as
``ffn_down_exps`` ``[E, H, I]``. The experts are MXFP4 blocks in OpenAI's files (GGML
type 39; gguf-py dequantizes them), F16/F32 in others. The metadata carries the window
(``attention.sliding_window``, every other layer sliding unless
``attention.sliding_window_pattern`` says otherwise), the expert counts and width and
YaRN's parameters; the clamped SwiGLU's limit is not in the file (llama.cpp fixes it at
gpt-oss's 7.0), nor YaRN's ``truncate`` (false in gpt-oss's config, as transformers runs
it; llama.cpp's RoPE rounds the correction range).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.common.load_errors import ModelLoadError

ARCHITECTURES: dict[str, tuple[str, str]] = {"gpt-oss": ("GptOssForCausalLM", "gpt_oss")}

# llama.cpp's fixed clamp of the SwiGLU (``LLM_FFN_SWIGLU_OAI_MOE``), gpt-oss's value.
SWIGLU_LIMIT = 7.0
# llama.cpp's default layer pattern: of each 2 layers the first slides (``set_swa_pattern(2)``).
_SLIDING_PATTERN = 2

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# A layer's GGUF stem -> the checkpoint's name under ``model.layers.N.`` (suffix kept).
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
}

_GATE, _UP = "ffn_gate_exps", "ffn_up_exps"


def gpt_oss_config(get, layers: int) -> dict[str, Any]:
    """gpt-oss's fields of ``config.json`` from the GGUF metadata.

    Args:
        get: ``get(key, default=None)`` reads ``gpt-oss.<key>``, raising where it is
            absent and has no default.
        layers: the block count.
    """
    pattern = get("attention.sliding_window_pattern", _SLIDING_PATTERN)
    if isinstance(pattern, list):  # one flag a layer
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(get("attention.sliding_window")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "swiglu_limit": SWIGLU_LIMIT,
    }


def checkpoint_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss GGUF's tensors (``(GGUF name, float values in [rows, cols] order)``, in
    the file's order) as the Hugging Face checkpoint's, under its names and in its
    layout: a layer's gate and up experts (weights, biases) are held until both have
    come, then interleaved into one ``gate_up_proj`` (``_bias``).

    Raises:
        ModelLoadError: a tensor that a gpt-oss checkpoint does not have, or a gate or up
            expert tensor without its other half.
    """
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for gguf_name, w in tensors:
        stem, _, suffix = gguf_name.rpartition(".")
        if stem in _TOP_LEVEL:
            yield f"{_TOP_LEVEL[stem]}.{suffix}", w
            continue
        parts = stem.split(".")
        kind = parts[2] if len(parts) == 3 and parts[0] == "blk" else ""
        prefix = f"model.layers.{parts[1]}." if kind else ""
        bias = suffix == "bias"
        if kind == "attn_sinks":
            yield prefix + "self_attn.sinks", w
        elif kind in _PER_LAYER:
            yield f"{prefix}{_PER_LAYER[kind]}.{suffix}", w
        elif kind == "ffn_down_exps":  # [E, H, I] -> [E, I, H]
            yield prefix + ("mlp.experts.down_proj_bias" if bias else "mlp.experts.down_proj"), \
                w if bias else w.transpose(1, 2).contiguous()
        elif kind in (_GATE, _UP):
            pair = halves.setdefault((parts[1], suffix), {})
            pair[kind] = w
            if len(pair) == 2:
                del halves[(parts[1], suffix)]
                yield prefix + ("mlp.experts.gate_up_proj_bias" if bias else "mlp.experts.gate_up_proj"), \
                    _interleaved(pair[_GATE], pair[_UP], bias)
        else:
            raise ModelLoadError(f"tensor {gguf_name} has no counterpart in a gpt-oss checkpoint")
    if halves:
        left = ", ".join(f"blk.{layer}.{'/'.join((_GATE, _UP))}.{suffix}" for layer, suffix in sorted(halves))
        raise ModelLoadError(f"gpt-oss experts with their gate or up half missing: {left}")


def _interleaved(gate: torch.Tensor, up: torch.Tensor, bias: bool) -> torch.Tensor:
    """Gate and up (``[E, I, H]`` weights or ``[E, I]`` biases) as the checkpoint's one
    tensor, columns interleaved (gate the even ones): ``[E, H, 2I]`` or ``[E, 2I]``."""
    both = torch.stack((gate, up), dim=2).flatten(1, 2)  # [E, 2I, ...], gate rows even
    return both if bias else both.transpose(1, 2).contiguous()
