"""A loaded GGUF model made ready for the CPU: every block-format projection replaced by
the CPU kernel's module that serves it (the C block GEMV's
:class:`~engine.layers.linear.cpu_blocks.CpuBlockLinear`, else torch's int4 matmul's
:class:`~engine.layers.linear.cpu_int4.CpuInt4Linear`), a tied head rescored in
float32, and the C decode layer (:mod:`engine.layers.cpu_decode`) where it runs every
layer."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.cpu_decode import CpuDecode
from engine.layers.linear.cpu_blocks import CpuBlockLinear, takes
from engine.layers.linear.cpu_int4 import CpuInt4Linear, QuantEmbedding, RescoredHead
from engine.layers.linear.gguf_blocks import QuantLinear
from engine.layers.moe.quant_experts import QuantExperts
from kernels.cpu import rows16
from kernels.cpu.moe_experts import takes as cpu_experts_takes
from kernels.switches import current


def pack_linears(module: nn.Module, dtype: torch.dtype, lib=None) -> None:
    """Replace every QuantLinear inside ``module`` (on the CPU) by a CPU kernel's module:
    with ``lib`` (the C kernels, :func:`engine.layers.linear.cpu_kernels.cpu_kernels`) those
    whose blocks the C GEMV reads become
    :class:`~engine.layers.linear.cpu_blocks.CpuBlockLinear` (the blocks as they are), the
    others a :class:`CpuInt4Linear` (model dtype ``dtype``)."""
    names = [n for n, m in module.named_modules() if isinstance(m, QuantLinear)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        linear = owner.get_submodule(leaf)
        if lib is not None and takes(linear):
            setattr(owner, leaf, CpuBlockLinear.from_quant_linear(lib, linear, dtype))
        else:
            setattr(owner, leaf, CpuInt4Linear.from_quant_linear(linear, dtype))


def _interleave_layers(layers, lib) -> None:
    """The C-read projections of ``layers`` interleaved by 16 rows (:mod:`kernels.cpu.rows16`)
    straight into one buffer of huge pages, in the order a decode step reads them, each old
    part dropped as its copy is written (the load's peak holds one part more, not the
    layers twice); where ``lib``'s build multiplies that layout."""
    if lib is None or not rows16.available(lib):
        return
    places = [(m, i) for layer in layers for m in layer.modules() if isinstance(m, CpuBlockLinear)
              for i, t in enumerate(m.types) if t is not None and rows16.takes(t, m.rows[i])]
    views = rows16.huge_buffer([tuple(m.part(i).shape) for m, i in places])
    for n, ((m, i), view) in enumerate(zip(places, views, strict=True)):
        rows16.interleave(m.part(i), m.types[i], lib, out=view)
        m.types[i] += rows16.SUFFIX
        setattr(m, f"part{i}", view)
        if n % 8 == 7:
            rows16.release_freed()  # the old parts' pages back to the system as the buffer fills


def _interleave_tied_head(head: nn.Module, embeddings: QuantEmbedding, lib) -> None:
    """A tied head of K-quant blocks (the embeddings' own, one part) interleaved by 16
    rows in place of the table it shares: the head multiplies the layout (1.7x a decode
    step's Q6_K head of 49,152 rows on 2 Zen 4 cores), the lookup puts its few rows back
    (:func:`kernels.cpu.block_gemv.dequantize_ids`); the same bytes, still one table."""
    kind = embeddings.type_name
    if (lib is None or not isinstance(head, CpuBlockLinear) or head.types != [kind] or kind not in rows16.KQUANTS
            or head.part(0).data_ptr() != embeddings.blocks.data_ptr() or not rows16.takes(kind, head.rows[0])
            or not rows16.available(lib)):
        return
    table = rows16.interleave(embeddings.blocks, kind, lib)
    embeddings.blocks = table
    embeddings.type_name = head.types[0] = kind + rows16.SUFFIX
    head.part0 = table
    rows16.release_freed()


def _interleave_experts(model: nn.Module, lib) -> None:
    """The routed experts the C kernels run on the CPU (:class:`QuantExperts` of types they
    read) interleaved by 16 rows per expert (:meth:`QuantExperts.interleave_rows16`), where
    ``lib``'s build multiplies that layout; MXFP4 experts and other types stay as loaded."""
    if lib is None or not rows16.available(lib):
        return
    for m in model.modules():
        if isinstance(m, QuantExperts) and m.gate.device.type == "cpu" and cpu_experts_takes(m.types):
            m.interleave_rows16(lib)
            rows16.release_freed()  # the file's blocks back to the system, layer by layer


def pack_model_for_cpu(model: nn.Module, dtype: torch.dtype, lib=None, decode_layers=None) -> nn.Module:
    """Replace every QuantLinear of ``model`` (on the CPU) as :func:`pack_linears` does; a
    head tied to embeddings in blocks that takes torch's int4 layout (bfloat16 logits)
    becomes a :class:`RescoredHead`; one the C kernels multiply keeps its float32 logits
    (16-bit activation codes: within about 1e-5 of the float32 product's norm). With ``lib``, a
    model whose every layer (of ``decode_layers``, the model's own by default) the C
    decode layer runs gets it too (:mod:`engine.layers.cpu_decode`). With the ``cpu_rows16``
    switch on, those layers' projections are interleaved by 16 rows, in one buffer of
    huge pages, an untied head's in a buffer of its own, and a tied head of K-quant
    blocks in the table it shares with the embeddings (:func:`_interleave_tied_head`; a
    tied head of other types is not: its lookup reads the file's rows), and the routed
    experts the C kernels run by 16 rows per expert (:func:`_interleave_experts`)."""
    if current().cpu_rows16:
        layers = model.model.layers if decode_layers is None else decode_layers
        for layer in layers:
            pack_linears(layer, dtype, lib)
        _interleave_layers(layers, lib)
        _interleave_experts(model, lib)
    pack_linears(model, dtype, lib)
    if current().cpu_rows16 and not model.config.tie_word_embeddings and isinstance(model.lm_head, CpuBlockLinear):
        _interleave_layers([model.lm_head], lib)  # an untied head: blocks of its own
    embeddings = model.model.embed_tokens
    if model.config.tie_word_embeddings and isinstance(embeddings, QuantEmbedding) and isinstance(
            model.lm_head, CpuInt4Linear | CpuBlockLinear):
        # (The loader's tied head holds the embeddings' blocks themselves: a CpuBlockLinear
        # of it shares them.)
        if current().cpu_rows16:
            _interleave_tied_head(model.lm_head, embeddings, lib)
        if isinstance(model.lm_head, CpuInt4Linear):  # bfloat16 logits: the top ones scored again
            model.lm_head = RescoredHead(model.lm_head, embeddings)
    if lib is not None:
        model.cpu_decode = CpuDecode.build(model, lib, decode_layers)
    return model
