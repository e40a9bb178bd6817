"""GGUF 4-bit projections repacked for torch's CPU int4 matmul.

A GGUF Q4_0/Q4_1 block holds 32 weights as 4-bit codes ``q`` in ``[0, 15]`` with a
float16 scale ``d`` (and, for Q4_1, a float16 minimum ``m``)::

    Q4_0: w = d * (q - 8)            Q4_1: w = d * q + m = d * (q - 8) + (m + 8 d)

torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``) dequantizes groupwise as
``w = (q - 8) * scale + zero`` (the tinygemm convention; torchao's
``pack_tinygemm_scales_and_zeros``), so both block types repack exactly, group size 32,
``scale = d`` and ``zero = 0`` (Q4_0) or ``m + 8 d`` (Q4_1): same weights, no
re-quantization. Parts of any other type are dequantized into the model dtype at load,
as the plain CPU path does.

Bytes per 32 weights: 16 (codes) + 2 x 4 (float32 scale and zero) = 24, against 18/20 in
the file and 128 as float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quant import reference
from kernels.quant.formats import block_format

GROUP = 32  # GGUF's block of 32 weights is the kernel's quantization group
INT4_TYPES = ("Q4_0", "Q4_1")


def int4_codes_scales_zeros(blocks: torch.Tensor, type_name: str, in_features: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split GGUF Q4_0/Q4_1 blocks into codes, scales and zeros.

    Args:
        blocks: uint8 ``[N, in_features / 32 * block_bytes]`` (CPU).
        type_name: ``"Q4_0"`` or ``"Q4_1"``.
        in_features: ``K``, a multiple of 32.

    Returns:
        ``(codes, scales, zeros)``: int32 ``[N, K]`` in ``[0, 15]``, float32 ``[N, K / 32]``
        twice, with ``w = (codes - 8) * scale + zero`` per group of 32.

    Raises:
        ValueError: another type, or blocks that do not hold rows of ``in_features``.
    """
    if type_name not in INT4_TYPES:
        raise ValueError(f"{type_name} has no int4 repacking; expected one of {', '.join(INT4_TYPES)}")
    fmt = block_format(type_name)
    n_blocks = in_features // GROUP
    if in_features % GROUP or blocks.dtype != torch.uint8 or tuple(blocks.shape[1:]) != (n_blocks * fmt.block_bytes,):
        raise ValueError(f"{type_name} blocks {blocks.dtype} {tuple(blocks.shape)} do not hold rows of {in_features}")
    b = blocks.reshape(blocks.shape[0], n_blocks, fmt.block_bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if type_name == "Q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        zeros, qs = m + 8 * d, b[..., 4:]
    else:
        zeros, qs = torch.zeros_like(d), b[..., 2:]
    # ggml's layout: byte j holds weight j in its low nibble and weight j + 16 in its high.
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32).reshape(blocks.shape[0], in_features)
    return codes, d, zeros


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout of ``codes`` (int32 ``[N, K]``) and its groups' ``scales``
    and ``zeros`` (``[N, K / 32]``): uint8 ``[N, K / 2]`` and ``dtype`` ``[K / 32, N, 2]``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scales_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(dtype).contiguous()
    return packed, scales_zeros


def int4_bytes(rows: int, in_features: int, itemsize: int) -> int:
    """Bytes of one repacked int4 part: codes plus a scale and a zero per group of 32."""
    return rows * in_features // 2 + rows * (in_features // GROUP) * 2 * itemsize


class CpuInt4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with the 4-bit row ranges of ``W`` in torch's CPU int4
    layout and the others dense (model dtype), stacked along ``out_features``.

    Built from a loaded :class:`~engine.models.quant_linear.QuantLinear` by
    :meth:`from_quant_linear`; ``x`` is ``[..., in_features]`` in the model dtype
    (float32 or bfloat16), the result ``[..., out_features]`` in the same dtype.
    """

    def __init__(self, in_features: int, out_features: int,
                 parts: list[tuple[int, torch.Tensor, torch.Tensor | None]], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.kinds: list[tuple[int, bool]] = []  # (rows, int4?) per part, top to bottom
        for i, (rows, w, scales_zeros) in enumerate(parts):
            self.register_buffer(f"part{i}", w)
            self.register_buffer(f"scales_zeros{i}", scales_zeros)
            self.kinds.append((rows, scales_zeros is not None))
        self.register_buffer("bias", bias)

    @classmethod
    def from_quant_linear(cls, module: nn.Module, dtype: torch.dtype) -> CpuInt4Linear:
        """Repack ``module`` (a loaded QuantLinear on the CPU): Q4_0/Q4_1 parts into int4,
        other block types dequantized to ``dtype``, dense parts kept."""
        parts: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        for spec, w in module.part_views():
            if spec.type_name in INT4_TYPES:
                packed, sz = pack_int4(*int4_codes_scales_zeros(w, spec.type_name, module.in_features), dtype)
                parts.append((spec.rows, packed, sz))
            elif spec.type_name is not None:
                parts.append((spec.rows, reference.dequantize(w, spec.type_name, module.in_features).to(dtype), None))
            else:
                parts.append((spec.rows, w, None))
        return cls(module.in_features, module.out_features, parts, module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        ys = []
        for i, (_, int4) in enumerate(self.kinds):
            w = getattr(self, f"part{i}")
            if int4:
                ys.append(torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, GROUP, getattr(self, f"scales_zeros{i}")))
            else:
                ys.append(F.linear(x2, w))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        mix = ", ".join(f"{'int4' if q else 'dense'}x{rows}" for rows, q in self.kinds)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{mix}]"


def pack_model_for_cpu(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace every QuantLinear of ``model`` (on the CPU) by its :class:`CpuInt4Linear`."""
    from engine.models.quant_linear import QuantLinear

    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, CpuInt4Linear.from_quant_linear(owner.get_submodule(leaf), dtype))
    return model
