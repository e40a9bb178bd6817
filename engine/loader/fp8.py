"""FP8 weights: which checkpoints are FP8, and the weight stream the FP8 model loads.

A model runs with FP8 projections (:class:`engine.layers.linear.fp8.Fp8Linear`) when
``--quantization fp8`` asks for it (a bfloat16/float32 checkpoint, quantized here as it
streams in, per output row) or when the checkpoint already is FP8 (``config.json``'s
``quantization_config.quant_method == "fp8"``: float8_e4m3fn weights with a
``weight_scale`` that is per tensor or per output channel, loaded as they are, the
per-tensor scale repeated on every row). Block-scaled FP8 checkpoints (``weight_scale_inv``
with ``weight_block_size``, DeepSeek's layout) are refused, as are static activation
scales (``input_scale``), which are dropped: the activations are scaled per token at run
time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from engine.common.load_errors import UnsupportedConfig
from engine.layers.linear.fp8 import FP8_WEIGHT_DTYPE, quantize_rows

QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "fp8")
# Hugging Face names of the dense projections that become FP8 (fused at load).
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def checkpoint_quant_method(model_dir: str | Path) -> str | None:
    """``quantization_config.quant_method`` of ``model_dir/config.json``, or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config")
    return quant.get("quant_method") if isinstance(quant, dict) else None


def resolve_quantization(quantization: str, model_dir: str | Path) -> str | None:
    """``"fp8"`` when the model loads with FP8 projections (asked for, or an FP8
    checkpoint), else None (the model dtype).

    Raises:
        UnsupportedConfig: an unknown ``quantization``; a block-scaled FP8 checkpoint.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise UnsupportedConfig(f"unknown --quantization {quantization!r}; choose one of "
                                f"{', '.join(QUANTIZATION_CHOICES)}")
    if checkpoint_quant_method(model_dir) == "fp8":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config["quantization_config"].get("weight_block_size"):
            raise UnsupportedConfig(f"{model_dir}: FP8 checkpoints with block scales (weight_block_size) are not "
                                    "supported; use the bfloat16 checkpoint with --quantization fp8")
        return "fp8"
    return "fp8" if quantization == "fp8" else None


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in _PROJ and ".experts." not in name


def fp8_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of ``(name, tensor)`` an FP8 model loads, from a checkpoint's.

    A dense projection's ``X.weight`` comes out as float8_e4m3fn ``[N, K]`` with
    ``X.weight_scale`` float32 ``[N]``: quantized here (:func:`quantize_rows`) when the
    checkpoint's is not FP8, else as stored, paired with its stored scale. Any other FP8
    tensor (a routed expert's) is dequantized with its scale; other tensors pass.

    Raises:
        UnsupportedConfig: a ``weight_scale_inv`` (block scales), or an FP8 weight
            without its scale (or a scale without its weight).
    """
    held: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale, and scales for their weight
    for name, t in weights:
        if name.endswith(".input_scale"):
            continue
        if name.endswith(".weight_scale_inv"):
            raise UnsupportedConfig(f"tensor {name}: FP8 block scales are not supported; use the bfloat16 "
                                    "checkpoint with --quantization fp8")
        if name.endswith(".weight_scale"):
            base = name.removesuffix("_scale")
            if base not in held:
                held[name] = t
                continue
            yield from _paired(base, held.pop(base), t)
        elif name.endswith(".weight") and t.dtype == FP8_WEIGHT_DTYPE:
            scale = held.pop(name + "_scale", None)
            if scale is None:
                held[name] = t
                continue
            yield from _paired(name, t, scale)
        elif name.endswith(".weight") and _is_projection(name) and t.dim() == 2:
            q, scale = quantize_rows(t)
            yield name, q
            yield name + "_scale", scale
        else:
            yield name, t
    if held:
        raise UnsupportedConfig(f"FP8 tensors without their pair (weight and weight_scale): {', '.join(sorted(held))}")


def _paired(name: str, weight: torch.Tensor, scale: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    rows = weight.shape[0]
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(rows)
    if scale.numel() != rows:
        raise UnsupportedConfig(f"tensor {name}_scale has {scale.numel()} values; per-tensor (1) or "
                                f"per-output-channel ({rows}) scales are supported")
    if _is_projection(name):
        yield name, weight
        yield name + "_scale", scale.contiguous()
    else:
        yield name, weight.float() * scale[:, None]

