"""GGUF projections kept in their file's blocks on the CPU, multiplied by the C block
GEMV (:mod:`kernels.cpu.block_gemv`): the CPU default for Q4_0/Q4_1/Q8_0 and K-quant
(Q4_K/Q5_K/Q6_K) weights where the C kernels build (:mod:`engine.layers.linear.cpu_kernels`);
elsewhere torch's int4 layout (:class:`~engine.layers.linear.cpu_int4.CpuInt4Linear`) stays,
and the K-quants are dequantized.

Blocks are used as the file stores them, so the weights cost their file bytes (Q4_1: 20
a block of 32, Q8_0: 34) and a head tied to embeddings in blocks shares their tensor
instead of holding a repacked copy.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import torch
from torch import nn

from engine.layers.linear.cpu_int4 import CpuInt4Linear
from kernels.cpu import rows16
from kernels.cpu.block_gemv import (
    GEMV_TYPE_IDS,
    TYPE_IDS,
    block_gemv,
    dequantize_rows,
    gemm_on_blocks,
)

# The projections' block types kept as stored: every type the C row products read but
# MXFP4 (gpt-oss's experts only; :mod:`kernels.cpu.moe_experts` runs those).
BLOCK_TYPES = frozenset(GEMV_TYPE_IDS) - {"MXFP4"}

# Where the C kernels have no AVX-512 block GEMM (gemm_on_blocks), the rows of activations
# from which a product dequantizes its weights, a chunk of rows at a time, and multiplies
# them in float32 by torch's GEMM instead of the AVX2 tile, whose per-block scaling costs
# more than dequantizing once when many rows share the weights (docs/cpu.md); prefill
# chunks take this path there.
GEMM_ROWS = 64
_CHUNK_FLOATS = 1 << 18  # a dequantized chunk of weight rows: 1 MiB, stays in L2


def takes(module: nn.Module) -> bool:
    """Whether a loaded QuantLinear has a part of a type the C GEMV reads (its other
    parts take torch's int4 layout or are dequantized, as the plan prices them)."""
    return any(spec.type_name in BLOCK_TYPES for spec, _ in module.part_views())


class _Parts:
    """The part_views of a QuantLinear's rows that the C GEMV does not read, for
    :meth:`CpuInt4Linear.from_quant_linear`."""

    def __init__(self, in_features: int, views: list) -> None:
        self.in_features = in_features
        self.out_features = sum(spec.rows for spec, _ in views)
        self.bias = None
        self._views = views

    def part_views(self) -> list:
        return self._views


class CpuBlockLinear(nn.Module):
    """``y = x @ W.T (+ bias)``, ``W``'s rows in parts stacked along ``out_features``: runs
    of GGUF blocks of one type the C GEMV reads (one kernel call each), and runs of other
    types as :class:`~engine.layers.linear.cpu_int4.CpuInt4Linear` (torch's int4 layout,
    or dequantized).

    ``forward(x)``: ``[..., in_features]`` float32 (or another float dtype, cast) to
    ``[..., out_features]`` in ``x``'s dtype.
    """

    def __init__(self, lib: ctypes.CDLL, in_features: int, parts: list[tuple[str | None, torch.Tensor | nn.Module]],
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib = lib
        self.in_features = in_features
        # Per part: its block type (None: a CpuInt4Linear of the other types) and rows.
        self.types = [type_name for type_name, _ in parts]
        self.rows = [w.shape[0] if t is not None else w.out_features for t, w in parts]
        self.out_features = sum(self.rows)
        self.others = nn.ModuleList()
        for i, (type_name, w) in enumerate(parts):
            if type_name is not None:
                self.register_buffer(f"part{i}", w)
            else:
                self.others.append(w)
        self.register_buffer("bias", bias)
        source: Counter[str] = Counter()  # GGUF block type -> weights
        for type_name, rows in zip(self.types, self.rows, strict=True):
            if type_name is not None:
                source[rows16.NAMES.get(type_name, type_name)] += rows * in_features
        for other in self.others:
            source.update(other.source_types)
        self.source_types = dict(source)

    @classmethod
    def from_quant_linear(cls, lib: ctypes.CDLL, module: nn.Module, dtype: torch.dtype,
                          interleave: bool = False) -> CpuBlockLinear:
        """``module`` (a loaded QuantLinear on the CPU that :func:`takes`) with adjacent
        parts of one C-read type concatenated, and runs of other parts repacked as
        :class:`CpuInt4Linear` (model dtype ``dtype``). ``interleave``: runs of Q4_0/Q4_1/
        Q8_0 whose rows are a multiple of 16 are copied interleaved by 16 rows (type
        ``<type>x16``, :mod:`kernels.cpu.rows16`) where ``lib`` multiplies that layout;
        ``module``'s own blocks are left as they are (a kept file form shares them)."""
        runs: list[tuple[str | None, list]] = []
        for spec, w in module.part_views():
            kind = spec.type_name if spec.type_name in BLOCK_TYPES else None
            if runs and runs[-1][0] == kind:
                runs[-1][1].append((spec, w))
            else:
                runs.append((kind, [(spec, w)]))
        parts: list[tuple[str | None, torch.Tensor | nn.Module]] = []
        for kind, views in runs:
            if kind is None:
                parts.append((None, CpuInt4Linear.from_quant_linear(_Parts(module.in_features, views), dtype)))
            else:
                ws = [w for _, w in views]
                blocks = (ws[0] if len(ws) == 1 else torch.cat(ws)).contiguous()
                if interleave and rows16.takes(kind, blocks.shape[0]) and rows16.available(lib):
                    parts.append((kind + rows16.SUFFIX, rows16.interleave(blocks, kind, lib)))
                else:
                    parts.append((kind, blocks))
        bias = module.bias.float() if module.bias is not None else None
        return cls(lib, module.in_features, parts, bias)

    def part(self, i: int) -> torch.Tensor:
        return getattr(self, f"part{i}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        at, other = 0, 0
        for i, (type_name, rows) in enumerate(zip(self.types, self.rows, strict=True)):
            if type_name in TYPE_IDS and x2.shape[0] >= GEMM_ROWS and not gemm_on_blocks(self.lib):
                self._gemm(x2, self.part(i), type_name, y[:, at:at + rows])
            elif type_name is not None:
                block_gemv(self.lib, x2, self.part(i), type_name, out=y[:, at:at + rows])
            else:
                y[:, at:at + rows] = self.others[other](x2)
                other += 1
            at += rows
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    def _gemm(self, x: torch.Tensor, blocks: torch.Tensor, type_name: str, out: torch.Tensor) -> None:
        """``out = x @ W.T`` for many rows ``x`` (float32 ``[M, K]``): ``W`` dequantized a
        chunk of rows at a time (float32, gguf's values) and multiplied by torch's GEMM,
        so these products are the float32 reference's to summation order."""
        step = max(16, _CHUNK_FLOATS // self.in_features)
        buf = torch.empty(min(step, blocks.shape[0]) * self.in_features, dtype=torch.float32)
        for lo in range(0, blocks.shape[0], step):
            hi = min(lo + step, blocks.shape[0])
            out[:, lo:hi] = x @ dequantize_rows(self.lib, blocks, type_name, lo, hi, out=buf).T

    def extra_repr(self) -> str:
        mix = ", ".join(f"{t or 'int4/dense'}x{r}" for t, r in zip(self.types, self.rows, strict=True))
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{mix}]"
