"""What a loaded model's weights take on the device and which block format holds most of
them, counted over every weight kind of :mod:`engine.layers` (dense parameters, GGUF
blocks on the GPU or repacked for the CPU, embeddings and experts kept in blocks) and
the rotary cache, as the plan prices them."""

from __future__ import annotations

from collections import Counter

from torch import nn

from engine.layers.linear.cpu_blocks import CpuBlockLinear
from engine.layers.linear.cpu_int4 import CpuInt4Linear, QuantEmbedding
from engine.layers.linear.gguf_blocks import QuantLinear
from engine.layers.moe.quant_experts import QuantExperts

# The rotary caches' buffer names (:mod:`engine.layers.rope`; Gemma's local layers keep
# their own, ``cos_sin_local``).
ROPE_BUFFERS = ("cos_sin_cache", "cos_sin_local")


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights on the device, as the plan counts them
    (:func:`engine.loader.weight_size.weight_bytes`): its parameters and the blocks,
    dense parts and biases of its :class:`QuantLinear` modules (or of their CPU
    repacking, :class:`~engine.layers.linear.cpu_int4.CpuInt4Linear`), of embeddings kept
    in blocks and of its :class:`~engine.layers.moe.quant_experts.QuantExperts`, and its
    float32 rotary cos/sin caches (once built: a model built on the meta device has
    none)."""
    params = sum(p.nbytes for p in model.parameters())
    kinds = QuantLinear | CpuInt4Linear | CpuBlockLinear | QuantEmbedding | QuantExperts
    # A tensor two modules share (a tied head reading the embeddings' blocks) counts once.
    buffers = {b.data_ptr(): b.nbytes for m in model.modules() if isinstance(m, kinds) for b in m.buffers()}
    return params + sum(buffers.values()) + rope_cache_bytes(model)


def rope_cache_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s rotary cos/sin caches (float32 ``[max_position_embeddings,
    rotary dim]`` each; 0 before they are built), each buffer counted once."""
    caches = {b.data_ptr(): b.nbytes for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in ROPE_BUFFERS}
    return sum(caches.values())


def quantized_format(model: nn.Module) -> str:
    """The block type that holds most of ``model``'s quantized projection weights (e.g.
    ``"Q4_1"``), counted over its :class:`QuantLinear` modules and their CPU repacking;
    ``""`` when none is quantized."""
    weights: Counter[str] = Counter()
    inner = {id(o) for m in model.modules() if isinstance(m, CpuBlockLinear) for o in m.others}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for p in m.parts:
                if p.type_name is not None:
                    weights[p.type_name] += p.rows * m.in_features
        elif isinstance(m, CpuInt4Linear | CpuBlockLinear) and id(m) not in inner:
            for type_name, count in m.source_types.items():
                weights[type_name] += count
    return weights.most_common(1)[0][0] if weights else ""
