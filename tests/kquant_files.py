"""A K-quant GGUF of real weights: the embedded default model widened so its projections
take K-quant blocks, re-encoded by :mod:`kernels.quant.kquant_encode`, for tests whose
answer depends on trained logits (random weights' logits are nearly flat, and any
rounding turns them)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from engine.loader.default_model import default_gguf_path
from kernels.quant.kquant_encode import ENCODERS
from kernels.quant.reference import dequantize

# The default model widened so every projection's rows are whole K-quant blocks.
WIDE_HIDDEN, WIDE_HEADS, WIDE_KV_HEADS = 768, 12, 4
# Q4_K_M's mix: Q4_K, and Q6_K for the (tied) head and for v and down (llama-quantize
# puts some layers' v and down in Q6_K; all of them here).
Q4_K_M_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


def _pad(w: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), dtype=np.float32)
    out[: w.shape[0], : w.shape[1]] = w
    return out


def write_widened_default(path: Path, types: dict[str, str] | None = None, default: str = "Q4_K") -> None:
    """The default model as an equivalent model of hidden size 768, 12 heads and 4 KV
    heads, every weight in K-quants (``types`` by tensor stem, else ``default``; default
    the Q4_K_M mix; ``F32`` keeps a tensor in float32): the trained weights of SmolLM2-135M padded with zeros, so every
    projection's rows are whole blocks of 256 (576 are not).

    In float arithmetic it computes what the source does: the padded parts of the
    residual stream stay zero (the extra rows of ``attn_output``/``ffn_down`` are zero),
    the 3 added heads have zero queries and read a zero KV head (the added KV head is
    the 4th, a group of 3 as before), and RMSNorm over 768 values of which 192 are zero is
    RMSNorm over 576 with the norm weights scaled by ``sqrt(576/768)`` and the epsilon by
    ``576/768`` (both done here). What differs from the source is the K-quant rounding.
    """
    types = Q4_K_M_TYPES if types is None else types
    reader = gguf.GGUFReader(default_gguf_path())
    hidden = int(reader.fields["llama.embedding_length"].contents())
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    head_dim, ratio = hidden // heads, hidden / WIDE_HIDDEN
    if heads // kv_heads != WIDE_HEADS // WIDE_KV_HEADS or WIDE_HEADS * head_dim != WIDE_HIDDEN:
        raise ValueError("the default model's heads do not widen to 12 heads of 4 groups")
    changed = {"llama.embedding_length": WIDE_HIDDEN, "llama.attention.head_count": WIDE_HEADS,
               "llama.attention.head_count_kv": WIDE_KV_HEADS,
               "llama.attention.layer_norm_rms_epsilon": float(reader.fields["llama.attention.layer_norm_rms_epsilon"]
                                                               .contents()) * ratio}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, changed.get(key, field.contents()), field.types[0], sub)
    h = WIDE_HIDDEN
    for t in reader.tensors:
        stem = t.name.split(".")[-2]
        if t.tensor_type.name == "F32" and len(t.shape) == 1:  # a norm: see the docstring
            writer.add_tensor(t.name, _pad(np.asarray(t.data, dtype=np.float32)[None] * np.sqrt(ratio), 1, h)[0])
            continue
        cols = int(t.shape[0])
        w = dequantize(torch.from_numpy(np.array(t.data)), t.tensor_type.name, cols).numpy()
        rows = {"attn_q": h, "attn_k": h // (WIDE_HEADS // WIDE_KV_HEADS), "attn_v": h // (WIDE_HEADS // WIDE_KV_HEADS),
                "attn_output": h, "ffn_down": h}.get(stem, w.shape[0])
        w = _pad(w, rows, h if cols == hidden else cols)
        kind = types.get(stem, default)
        if kind == "F32":
            writer.add_tensor(t.name, w)
        else:
            writer.add_tensor(t.name, ENCODERS[kind](w), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
