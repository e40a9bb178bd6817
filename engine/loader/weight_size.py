"""What a model's weights take on the device, computed from a model built on the meta
device (exact, nothing allocated): dense weights in a dtype, FP8 projections, the routed
experts' share, the parameter count. A GGUF in blocks is priced by
:func:`engine.loader.gguf_quant.gguf_weight_size`, in the same :class:`WeightSize`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.common.config import ModelConfig
from engine.common.units import fmt_bytes
from engine.loader.meta_build import build_on_meta


@dataclass(frozen=True)
class WeightSize:
    """Device bytes of a model's weights and how they are stored.

    Attributes:
        bytes: weights plus the float32 RoPE cache, as
            :func:`engine.loader.weight_size.weight_bytes` counts them.
        source: what stores them (``"GGUF"`` blocks, ``"FP8"`` projections).
        mix: the type mix, e.g. ``"210 Q4_1 blocks 61.0 MiB; bfloat16 62 tensors
            (1 Q8_0, 61 F32) 54.4 MiB"``.
        expert_layer_bytes: a mixture of experts' routed experts, bytes per MoE layer
            (in ``ModelConfig.moe_layers`` order) as they are stored, blocks or
            dequantized; empty where the size does not split them out (the plan then
            prices the experts from the dense shapes).
        experts_in_blocks: whether every layer's routed experts are GGUF blocks (and so
            are the host tier and the expert cache of ``--cpu-experts``).
        decoder_layer_bytes: bytes per decoder layer as stored (a GGUF's ``blk.N``
            tensors); empty where not counted.
        host_layer_bytes: the same layers in the CPU path's layout, what
            ``--cpu-layers`` holds in host memory; empty where not counted.
    """

    bytes: int
    mix: str
    source: str = "GGUF"
    expert_layer_bytes: tuple[int, ...] = ()
    experts_in_blocks: bool = False
    decoder_layer_bytes: tuple[int, ...] = ()
    host_layer_bytes: tuple[int, ...] = ()



def weight_bytes(config: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Device bytes :func:`~engine.loader.load.load_model` will allocate for ``config`` in ``dtype`` (and
    ``quantization``: FP8 projections take one byte per weight plus a float32 scale per
    row): every parameter, the blocks of routed experts kept as the checkpoint stores them
    (gpt-oss's MXFP4: ``ModelConfig.expert_block_type``), plus the float32 RoPE cos/sin
    cache. Computed from the
    shapes of a model built on the meta device, so it is exact and allocates nothing."""
    model = build_on_meta(config, dtype, quantization)
    params = sum(p.numel() * p.element_size() for p in model.parameters()) + _expert_block_bytes(model)
    rope_cache = config.max_position_embeddings * (config.rotary_dim or config.head_dim) * 4  # float32
    if config.gemma4 is not None:  # a cache per layer kind, each at its heads' size
        return params + config.max_position_embeddings * (config.gemma4.global_head_dim + config.gemma4.sliding_head_dim) * 4
    return params + rope_cache * (2 if config.rope_local is not None else 1)  # Gemma 3: local layers' own


def layer_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> tuple[int, ...]:
    """Bytes of each decoder layer's dense weights in ``dtype``, from the shapes of a model
    built on the meta device (exact, nothing allocated)."""
    model = build_on_meta(config, dtype)
    return tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)


def parameter_count(config: ModelConfig) -> int:
    """The model's parameters, from the shapes of a model built on the meta device
    (whatever the weights' storage: a tied head is counted once)."""
    return sum(p.numel() for p in build_on_meta(config).parameters())


def fp8_weight_size(config: ModelConfig, dtype: torch.dtype) -> WeightSize:
    """What :func:`~engine.loader.load.load_model` allocates with ``quantization="fp8"`` (exact, as
    :func:`weight_bytes`), with the mix: FP8 projections and their scales, the rest in
    ``dtype``."""
    model = build_on_meta(config, dtype, "fp8")
    by_dtype: dict[str, list[int]] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        entry = by_dtype.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += p.numel() * p.element_size()
    mix = "; ".join(f"{name} {n} tensors {fmt_bytes(b)}" for name, (n, b) in sorted(by_dtype.items()))
    return WeightSize(bytes=weight_bytes(config, dtype, "fp8"), mix=mix, source="FP8")


def expert_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The part of :func:`weight_bytes` that the routed experts of a mixture of experts
    take (``mlp.experts.*``, their blocks where kept so; not the router or a shared
    expert); 0 for a dense model."""
    if not config.is_moe:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    model = build_on_meta(config)
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * itemsize + _expert_block_bytes(model)


def _expert_block_bytes(model: torch.nn.Module) -> int:
    """Bytes of the routed experts' blocks a model built on the meta device holds (uint8
    buffers of ``mlp.experts``; none where the experts are dense)."""
    return sum(b.numel() for n, b in model.named_buffers() if ".experts." in n and b.dtype == torch.uint8)
