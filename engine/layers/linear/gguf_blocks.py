"""A linear layer whose weight stays in GGUF block format on the device.

The weight ``[out_features, in_features]`` is one or more row ranges ("parts"), stacked
along ``out_features`` as the fused q/k/v and gate/up projections stack their shards:
a part is either GGUF blocks of a type :mod:`kernels.quant` reads (uint8
``[rows, in_features / block_elements * block_bytes]``) or a dense weight in the model
dtype (a shard stored as F16/F32 or a type not kept quantized). Adjacent parts of one
type are merged at build time, so a fused projection whose shards share a type (the
common case) is one kernel launch; so are decode rows of two parts that the int8 GEMV
reads (a Q4_K_M file's q/k in Q4_K over v in Q6_K).

On CUDA the product is :func:`kernels.quant.triton_kernel.quant_matmul` (the GEMV for
a few decode rows, the tile GEMM for more, cuBLAS on the weight dequantized whole for a
long prefill chunk: one transient weight for all the parts), over Q6_K parts repacked at load into aligned planes
(:meth:`QuantLinear.repack_for_kernels`); elsewhere the reference, which dequantizes through
``gguf`` on every call (correct, slow: the CPU path dequantizes at load instead).
Decode rows for the int8 GEMV are quantized once for all parts, by a launch of their
own or, when the decoder's norm or SiLU-and-mul kernel wrote them, by that kernel
(:meth:`QuantLinear.wants_int8`, ``forward``'s ``q8``).

All tensors are buffers, not parameters: ``CausalLM.load_weights`` fills the parameters
it knows and the quantized loader fills these (:mod:`engine.loader.gguf_quant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.dispatch import use_triton
from kernels.quant import reference
from kernels.quant.formats import FORMATS, tensor_bytes
from kernels.quant.repack import q6k_to_planes, repackable, repacked_type
from kernels.switches import current


@dataclass(frozen=True)
class PartSpec:
    """Rows ``rows`` of the weight, stored as GGUF ``type_name`` blocks, or dense when
    ``type_name`` is None."""

    rows: int
    type_name: str | None


def merge_parts(parts: list[PartSpec]) -> list[PartSpec]:
    """Adjacent parts of one storage merged (their rows concatenate)."""
    merged: list[PartSpec] = []
    for p in parts:
        if merged and merged[-1].type_name == p.type_name:
            merged[-1] = PartSpec(merged[-1].rows + p.rows, p.type_name)
        else:
            merged.append(p)
    return merged


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` held as GGUF blocks.

    Args:
        in_features: ``K``; a multiple of every quantized part's block size.
        parts: the row ranges, top to bottom (merged with :func:`merge_parts`).
        bias: whether there is a bias ``[out_features]`` (model dtype).
        dtype: dtype of dense parts and the bias.

    Buffers: ``part{i}`` for each part; ``bias`` when present. Build under
    ``torch.device("meta")`` and materialize (:func:`engine.loader.meta_build.materialize`)
    like the rest of the model.
    """

    def __init__(self, in_features: int, parts: list[PartSpec], *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = merge_parts(parts)
        self.out_features = sum(p.rows for p in self.parts)
        for i, p in enumerate(self.parts):
            if p.type_name is None:
                buf = torch.empty(p.rows, in_features, dtype=dtype)
            else:
                fmt = FORMATS[p.type_name]
                buf = torch.empty(p.rows, tensor_bytes(p.type_name, (1, in_features), 0), dtype=torch.uint8)
                assert buf.shape[1] == in_features // fmt.block_elements * fmt.block_bytes
            self.register_buffer(f"part{i}", buf)
        self.register_buffer("bias", torch.empty(self.out_features, dtype=dtype) if bias else None)

    def part_views(self) -> list[tuple[PartSpec, torch.Tensor]]:
        return [(p, getattr(self, f"part{i}")) for i, p in enumerate(self.parts)]

    def repack_for_kernels(self) -> None:
        """Rearrange in place, once the blocks are filled, each part whose GGUF type has a
        layout the CUDA kernels read with wider loads (:mod:`kernels.quant.repack`: Q6_K
        as ``Q6_K_P``, the same bytes); its spec then names the layout. Rows stay rows,
        so the bytes and the plan's price do not change."""
        for i, (spec, w) in enumerate(self.part_views()):
            if spec.type_name is not None and repackable(spec.type_name, w):
                q6k_to_planes(w, out=w)
                self.parts[i] = PartSpec(spec.rows, repacked_type(spec.type_name))

    def forward(self, x: torch.Tensor, q8=None) -> torch.Tensor:
        """``x @ W.T (+ bias)``.

        Args:
            x: ``[..., in_features]`` in the model dtype.
            q8: ``x``'s rows ``[rows, in_features]`` already quantized for the int8 GEMV
                (:class:`kernels.quant.triton_activations.Q8Activations`), by the kernel that
                wrote ``x`` when :meth:`wants_int8` asked it to: used instead of a
                quantizing launch here. None: quantized here if the GEMV needs it.

        Returns:
            ``[..., out_features]`` in ``x``'s dtype.
        """
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        views = self.part_views()
        if q8 is None:
            q8 = self._int8_activations(x2)
        if len(views) == 1:
            y = self._part(x2, *views[0], q8=q8)
        elif self._dequantizes_whole(x2):  # a long prefill chunk: one weight, one cuBLAS product
            y = x2 @ self._dequantized(views, x2.dtype).T
        elif self._int8_one_launch(x2):  # decode rows, both parts on the int8 GEMV
            from kernels.quant.triton_int8 import int8_gemv_parts

            y = int8_gemv_parts(q8 if q8 is not None else x2.contiguous(), [(w, spec.type_name) for spec, w in views])
        else:  # each part writes its columns of one output: no concatenation
            y = torch.empty(x2.shape[0], self.out_features, device=x.device, dtype=x.dtype)
            col = 0
            for spec, w in views:
                self._part(x2, spec, w, y[:, col : col + spec.rows], q8=q8)
                col += spec.rows
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def wants_int8(self, x: torch.Tensor) -> bool:
        """Whether the kernel that writes this projection's input ``x`` should also write
        it quantized for the int8 GEMV (``quantize=True`` of the RMSNorm and SiLU-and-mul
        kernels) and hand it to :meth:`forward` as ``q8``: the rows :meth:`forward` would
        otherwise quantize in a launch of their own, unless the ``quant_int8_producer``
        switch is off (:mod:`kernels.switches`). Shapes only, no host sync: safe while a CUDA
        graph is captured.

        Args:
            x: the input, or the producer's (any tensor of the same rows on the same
                device: only its device and row count are read).
        """
        if not self._quantizes_apart(x):
            return False
        from kernels.quant.int8_choice import int8_from_producer

        return int8_from_producer()

    def _quantizes_apart(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are decode rows that some part's GEMV reads as int8
        codes quantized apart (by a launch of their own, shared by the parts)."""
        if not use_triton(x):
            return False
        from kernels.quant.int8_choice import int8_quantize_apart, uses_int8_dot
        from kernels.quant.triton_kernel import gemv_max_rows

        return (math.prod(x.shape[:-1]) <= gemv_max_rows() and int8_quantize_apart()
                and any(p.type_name and uses_int8_dot(p.type_name) for p in self.parts))

    def _int8_activations(self, x: torch.Tensor):
        """Decode rows ``x [rows, in_features]`` quantized to int8 once for every part
        whose GEMV takes them (:mod:`kernels.quant.triton_int8`) when that GEMV reads
        them quantized apart (the default), else None (the ``quant_int8_fuse`` switch:
        each GEMV quantizes the rows as it reads them, no launch of its own)."""
        if not self._quantizes_apart(x):
            return None
        from kernels.quant.triton_activations import quantize_activations

        return quantize_activations(x.contiguous())

    def _int8_one_launch(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are decode rows for a GEMV over all the parts in one launch
        (:func:`kernels.quant.int8_choice.int8_parts_in_one_launch`)."""
        if not use_triton(x):
            return False
        from kernels.quant.int8_choice import int8_parts_in_one_launch
        from kernels.quant.triton_kernel import gemv_max_rows

        return x.shape[0] <= gemv_max_rows() and int8_parts_in_one_launch([p.type_name for p in self.parts])

    @staticmethod
    def _dequantizes_whole(x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are a prefill chunk long enough for the weight to be
        dequantized whole and multiplied by cuBLAS (the ``quant_dequant_rows`` switch)."""
        if not use_triton(x):
            return False
        from kernels.quant.triton_dequant import dequantize_rows

        return 0 < dequantize_rows() <= x.shape[0]

    def _dequantized(self, views: list[tuple[PartSpec, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
        """The whole weight ``[out_features, in_features]`` in ``dtype``, each part's rows
        decoded (or copied, a dense part) into one transient tensor."""
        from kernels.quant.triton_dequant import dequantize

        w = torch.empty(self.out_features, self.in_features, device=views[0][1].device, dtype=dtype)
        row = 0
        for spec, part in views:
            if spec.type_name is None:
                w[row : row + spec.rows].copy_(part)
            else:
                dequantize(part, spec.type_name, self.in_features, dtype, out=w[row : row + spec.rows])
            row += spec.rows
        return w

    @staticmethod
    def _part(x: torch.Tensor, spec: PartSpec, w: torch.Tensor, out: torch.Tensor | None = None,
              q8=None) -> torch.Tensor:
        """``x @ w.T`` of one part, into ``out`` (a column slice) when given; ``q8``:
        ``x`` quantized for the int8 GEMV."""
        if spec.type_name is not None and use_triton(x):
            from kernels.quant.triton_kernel import quant_matmul

            return quant_matmul(x.contiguous(), w, spec.type_name, out=out, q8=q8)
        y = F.linear(x, w) if spec.type_name is None else reference.quant_matmul(x, w, spec.type_name)
        if out is None:
            return y
        out.copy_(y)
        return out

    def extra_repr(self) -> str:
        mix = ", ".join(f"{p.type_name or 'dense'}x{p.rows}" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{mix}]"


def repack_model_for_kernels(model: nn.Module) -> None:
    """:meth:`QuantLinear.repack_for_kernels` on every quantized projection of ``model``,
    once its blocks are on a CUDA device (the loader's and the hybrid load's last step);
    the ``quant_repack`` switch off (:mod:`kernels.switches`) keeps GGUF's layout (to
    time it)."""
    if not current().quant_repack:
        return
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.repack_for_kernels()
