"""Build a model and load its weights (their sizes without loading them:
:mod:`engine.loader.weight_size`)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.common.config import ModelConfig
from engine.common.load_errors import WeightMismatch
from engine.layers.linear.fp8 import FP8_MAX, FP8_WEIGHT_DTYPE
from engine.loader.fp8 import fp8_weights
from engine.loader.hf_config import load_model_config
from engine.loader.meta_build import build_on_meta, materialize
from engine.loader.weights import iter_weights
from engine.models.decoder import CausalLM
from engine.parallel.group import TensorParallel
from engine.parallel.shard import rank_config, shard_weights


def load_model(
    model_dir: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    load_format: str = "auto",
    quantized_gguf: str | Path | None = None,
    quantization: str | None = None,
    tp: TensorParallel | None = None,
    embeddings_in_blocks: bool = False,
    experts_in_blocks: bool | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Load a Hugging Face model folder onto ``device`` in ``dtype``.

    The model is built on the meta device and materialized uninitialized, so the weights
    are written once, straight into their final place. Returns ``(model, config)``, the
    model in eval mode with its RoPE cache built (float32).

    A folder converted from a GGUF without its weights (what
    :func:`engine.loader.resolve.resolve_model` makes) gets them written on this first
    read (:func:`engine.loader.gguf_convert.ensure_gguf_weights`).

    With ``quantized_gguf`` (the GGUF file ``model_dir`` was converted from), the
    weights come from that file instead (none are written into the folder), its projections in GGUF block format
    (:func:`engine.loader.gguf_quant.load_gguf_quantized`; ``embeddings_in_blocks``: the
    CPU engine's layout, embeddings in blocks too; ``experts_in_blocks``: a mixture of
    experts' routed experts in blocks, None for everywhere but on the CPU, True to read
    a CUDA engine's layout into host memory first).

    With ``quantization="fp8"`` the dense projections are
    :class:`~engine.layers.linear.fp8.Fp8Linear` (float8_e4m3fn, a float32 scale per
    output row), filled from the checkpoint through :func:`engine.loader.fp8.fp8_weights`
    (quantized as they stream in, or an FP8 checkpoint's as stored).

    ``load_format="dummy"`` skips the weight files and fills every parameter with small
    random values (norms with ones): a model of real shape for memory and speed
    measurements, from a folder that holds only ``config.json``.

    With ``tp`` (a rank of a tensor-parallel group) the model is built at this rank's
    shard shapes and holds its slice of the weights (:mod:`engine.parallel.shard`); the
    returned config is still the whole model's.

    Raises:
        ValueError: an unknown ``load_format``; a model ``tp`` cannot split, or ``tp``
            with ``quantized_gguf``.
        ModelNotFound, UnsupportedArchitecture, ConfigFieldMissing, UnsupportedConfig:
            from reading ``config.json``.
        CorruptWeights: a safetensors file is truncated or unreadable.
        ModelNotFound, ModelLoadError: from writing a GGUF conversion's weights (the GGUF
            file is gone or changed, the folder is read-only).
        WeightMismatch: the tensors do not match the config (missing, unexpected, shape);
            the message names ``model_dir`` and the tensors.
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    if quantized_gguf is not None and load_format == "auto":
        if tp is not None:
            raise ValueError("GGUF block weights are not split across ranks; use --tensor-parallel-size 1 "
                             "or let the GGUF load dequantized")
        from engine.loader.gguf_quant import load_gguf_quantized

        return load_gguf_quantized(config, quantized_gguf, device, dtype, experts_in_blocks=experts_in_blocks,
                                   embeddings_in_blocks=embeddings_in_blocks), config
    if load_format == "auto":  # before the model takes its memory: the step dequantizes
        from engine.loader.gguf_convert import ensure_gguf_weights

        ensure_gguf_weights(model_dir)  # a GGUF conversion gets its float tensors on first read
    shapes = config if tp is None else rank_config(config, tp)
    model = build_on_meta(shapes, dtype, quantization)
    materialize(model, device)
    model.init_rope_cache()
    if tp is not None:
        model.use_parallel(tp, config.vocab_size)
    if load_format == "dummy":
        _fill_dummy(model)
        return model.eval(), config
    if load_format != "auto":
        raise ValueError(f"unknown load_format {load_format!r}; use 'auto' or 'dummy'")
    try:
        weights = iter_weights(model_dir)
        weights = weights if tp is None else shard_weights(weights, config, tp)
        model.load_weights(fp8_weights(weights) if quantization == "fp8" else weights)
    except WeightMismatch as e:
        raise WeightMismatch(f"{model_dir}: {e}") from None
    return model.eval(), config


@torch.no_grad()
def _fill_dummy(model: CausalLM) -> None:
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.dtype == FP8_WEIGHT_DTYPE:  # FP8 codes over their range, scaled to the same +-0.02
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-FP8_MAX, FP8_MAX, generator=g))
        elif name.endswith("weight_scale"):
            p.fill_(0.02 / FP8_MAX)
        else:
            p.uniform_(-0.02, 0.02, generator=g)
