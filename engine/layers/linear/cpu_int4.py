"""GGUF projections repacked for torch's CPU int4 matmul, and embeddings kept in blocks.

Every type handled here stores a block of 32 weights as integer codes ``u`` with a
float16 scale ``d`` and an offset ``c`` per block, ``w = d * u + c`` (ggml-common.h)::

    Q4_0: u in [0, 15],  c = -8 d          Q4_1: u in [0, 15],  c = m (float16 minimum)
    Q5_0: u in [0, 31],  c = -16 d         Q5_1: u in [0, 31],  c = m
    Q8_0: u = q + 128 in [0, 255], c = -128 d

torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``) dequantizes groupwise as
``w = (q - 8) * scale + zero`` with ``q`` in ``[0, 15]`` (the tinygemm convention;
torchao's ``pack_tinygemm_scales_and_zeros``), group size 32 here: GGUF's block.

- 4-bit codes are one such **plane**: ``scale = d``, ``zero = c + 8 d``.
- Wider codes split as ``u = 16 h + l`` (``h``, ``l`` in ``[0, 15]``) into two planes::

      w = 16 d (h - 8) + [d (l - 8) + 136 d + c]

  so the high plane has ``scale = 16 d, zero = 0`` and the low one ``scale = d,
  zero = 136 d + c`` (5-bit codes are first moved to the middle of ``[0, 255]``, see
  :func:`int4_planes`). The planes are stacked along K (the weight becomes ``[N, 2 K]``)
  and the input repeated (``[x, x]``): one int4 matmul gives the exact sum.

The kernel is fast only with bfloat16 activations and bfloat16 scales and zeros
(measured on AVX-512 and AVX2 CPUs: a ``[3072, 576]`` product at one row took 131 us
with bfloat16 against 3,445 us with float32 activations), so the matmul runs in
bfloat16 and returns the model dtype. What bfloat16 rounds: the activations (8 bits of
mantissa) and ``d`` (float16 has 11), so a weight moves by at most ``|q - 8| * d / 512``,
1/64 of a 4-bit step (Q8_0: a quarter of its step, what a bfloat16 weight also loses).
Parts of other types are dequantized into the model dtype at load, as the plain CPU path
does; the dequantized float32 weights stay the reference (tests/test_cpu_quant.py).

Bytes per 32 weights: 16 per plane (codes) plus 2 x 2 per plane (bfloat16 scale and
zero): Q4_x 20, Q5_x/Q8_0 40, against 128 as float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear.cpu_kernels import cpu_kernels
from kernels.cpu import block_gemv as c_blocks
from kernels.quant import reference
from kernels.quant.formats import block_format

GROUP = 32  # GGUF's block of 32 weights is the kernel's quantization group
# Code width in bits of each block type this module reads; 4-bit codes take one plane.
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}
PACK_DTYPE = torch.bfloat16  # the dtype torch's CPU int4 kernel is fast in
_N_MULTIPLE = 16  # the CPU int4 layout packs rows in 16s
_PACK_ROWS = 1024  # rows repacked at a time: a multiple of every block the layout uses


def planes(type_name: str) -> int:
    """int4 planes a block type repacks into: 1 for 4-bit codes, 2 for wider ones."""
    return 1 if CODE_BITS[type_name] == 4 else 2


def block_codes(blocks: torch.Tensor, type_name: str, in_features: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack GGUF blocks into codes, scales and offsets: ``w = d * u + c`` per block.

    Args:
        blocks: uint8 ``[N, in_features / 32 * block_bytes]`` (CPU).
        type_name: a key of :data:`CODE_BITS`.
        in_features: ``K``, a multiple of 32.

    Returns:
        ``(u, d, c)``: int32 ``[N, K]`` (``[0, 2**bits)``), float32 ``[N, K / 32]`` twice.

    Raises:
        ValueError: another type, or blocks that do not hold rows of ``in_features``.
    """
    if type_name not in CODE_BITS:
        raise ValueError(f"{type_name} has no int4 repacking; expected one of {', '.join(CODE_BITS)}")
    fmt = block_format(type_name)
    n_blocks = in_features // GROUP
    if in_features % GROUP or blocks.dtype != torch.uint8 or tuple(blocks.shape[1:]) != (n_blocks * fmt.block_bytes,):
        raise ValueError(f"{type_name} blocks {blocks.dtype} {tuple(blocks.shape)} do not hold rows of {in_features}")
    rows = blocks.shape[0]
    b = blocks.reshape(rows, n_blocks, fmt.block_bytes)

    def f16(lo: int) -> torch.Tensor:
        return b[..., lo:lo + 2].contiguous().view(torch.float16).squeeze(-1).float()

    d = f16(0)
    if type_name == "Q8_0":
        u = b[..., 2:34].view(torch.int8).to(torch.int32) + 128
        return u.reshape(rows, in_features), d, -128 * d
    has_min = type_name in ("Q4_1", "Q5_1")
    at = 4 if has_min else 2
    high_bits = None
    if CODE_BITS[type_name] == 5:
        qh = b[..., at:at + 4].to(torch.int32)  # little-endian 32 bits: weight j's fifth bit
        qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        high_bits = (qh[..., None] >> torch.arange(32, dtype=torch.int32)) & 1
        at += 4
    qs = b[..., at:at + 16]
    # ggml's layout: byte j holds weight j in its low nibble and weight j + 16 in its high.
    u = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)
    if high_bits is not None:
        u = u | high_bits << 4
    c = f16(2) if has_min else -(1 << (CODE_BITS[type_name] - 1)) * d
    return u.reshape(rows, in_features), d, c


def dequantize_rows(blocks: torch.Tensor, type_name: str, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` weights in ``dtype`` from GGUF blocks (``w = d * u + c``, computed in float32)."""
    u, d, c = block_codes(blocks, type_name, in_features)
    w = u.float().view(u.shape[0], in_features // GROUP, GROUP) * d[..., None] + c[..., None]
    return w.view(u.shape[0], in_features).to(dtype)


def int4_planes(blocks: torch.Tensor, type_name: str, in_features: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int4 planes of GGUF blocks, stacked along K (module docstring).

    Returns:
        ``(codes, scales, zeros)``: int32 ``[N, P * K]`` in ``[0, 15]`` and float32
        ``[N, P * K / 32]`` twice, ``P`` = :func:`planes`, with
        ``sum over planes of (codes - 8) * scale + zero`` = the block's weights.
    """
    u, d, c = block_codes(blocks, type_name, in_features)
    if planes(type_name) == 1:
        return u, d, c + 8 * d
    # Centre the codes on 128 first (Q5: u + 112, w = d (u + 112) + c - 112 d): the high
    # plane's (h - 8) then stays small, instead of two large terms of opposite sign whose
    # bfloat16 rounding would not cancel.
    shift = 128 - (1 << (CODE_BITS[type_name] - 1)) if type_name != "Q8_0" else 0
    u, c = u + shift, c - shift * d
    return (torch.cat([u >> 4, u & 0x0F], dim=1), torch.cat([16 * d, d], dim=1),
            torch.cat([torch.zeros_like(d), 136 * d + c], dim=1))


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout of ``codes`` (int32 ``[N, K]``, ``N`` a multiple of 16) and
    its groups' ``scales`` and ``zeros`` (``[N, K / 32]``): uint8 ``[N, K / 2]`` and
    bfloat16 ``[K / 32, N, 2]``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scales_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(PACK_DTYPE).contiguous()
    return packed, scales_zeros


def _pack_rows(parts: list[tuple[torch.Tensor, str]], in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_int4` of the planes of ``parts`` (blocks, type) stacked along N, made
    :data:`_PACK_ROWS` rows at a time: torch's layout packs rows in blocks of at most 64
    that do not depend on each other (checked against one whole call in
    tests/test_cpu_quant.py), so a large head never holds 4-byte codes for all its
    weights at once."""
    total = sum(w.shape[0] for w, _ in parts)
    packed, scales_zeros = [], []
    for lo in range(0, total, _PACK_ROWS):
        hi, at, pieces = min(lo + _PACK_ROWS, total), 0, []
        for w, type_name in parts:
            a, b = max(lo - at, 0), min(hi - at, w.shape[0])
            if a < b:
                pieces.append(int4_planes(w[a:b], type_name, in_features))
            at += w.shape[0]
        p, sz = pack_int4(*(torch.cat(x, dim=0) for x in zip(*pieces, strict=True)))
        packed.append(p)
        scales_zeros.append(sz)
    return torch.cat(packed, dim=0), torch.cat(scales_zeros, dim=1)


def packable(type_name: str | None, rows: int) -> bool:
    """Whether a part of ``rows`` rows of ``type_name`` takes the int4 layout."""
    return type_name in CODE_BITS and rows % _N_MULTIPLE == 0


def packed_bytes(rows: int, in_features: int, type_name: str) -> int:
    """Bytes of one repacked part: codes plus a bfloat16 scale and zero per group of 32,
    per plane."""
    k = planes(type_name) * in_features
    return rows * k // 2 + rows * (k // GROUP) * 2 * 2


class CpuInt4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with row ranges of ``W`` in torch's CPU int4 layout and the
    others dense (model dtype), stacked along ``out_features``.

    Built from a loaded :class:`~engine.layers.linear.gguf_blocks.QuantLinear` by
    :meth:`from_quant_linear`, which merges adjacent packable parts of the same plane
    count into one matrix (q/k/v of one type: one kernel call). ``x`` is
    ``[..., in_features]`` in the model dtype (float32 or bfloat16); the result
    ``[..., out_features]`` in the same dtype.
    """

    def __init__(self, in_features: int, out_features: int,
                 parts: list[tuple[int, int, torch.Tensor, torch.Tensor | None]], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.kinds: list[tuple[int, int]] = []  # (rows, planes; 0 = dense) per part, top to bottom
        for i, (rows, n_planes, w, scales_zeros) in enumerate(parts):
            self.register_buffer(f"part{i}", w)
            self.register_buffer(f"scales_zeros{i}", scales_zeros)
            self.kinds.append((rows, n_planes))
        self.register_buffer("bias", bias)
        self.source_types: dict[str, int] = {}  # GGUF block type -> weights repacked from it
        # The common case, decided once: one 4-bit matrix and no bias (no bookkeeping).
        self._single = len(self.kinds) == 1 and self.kinds[0][1] == 1 and bias is None

    @classmethod
    def from_quant_linear(cls, module: nn.Module, dtype: torch.dtype) -> CpuInt4Linear:
        """Repack ``module`` (a loaded QuantLinear on the CPU): the parts of
        :data:`CODE_BITS` types into int4 planes, other block types dequantized to
        ``dtype``, dense parts kept."""
        k = module.in_features
        # Runs of packable parts with the same plane count become one matrix.
        groups: list[tuple[int, list[tuple[torch.Tensor, str]] | torch.Tensor]] = []
        source_types: dict[str, int] = {}
        for spec, w in module.part_views():
            if packable(spec.type_name, spec.rows):
                source_types[spec.type_name] = source_types.get(spec.type_name, 0) + spec.rows * k
                n_planes = planes(spec.type_name)
                if not (groups and groups[-1][0] == n_planes):
                    groups.append((n_planes, []))
                groups[-1][1].append((w, spec.type_name))
            elif spec.type_name is not None:
                groups.append((0, reference.dequantize(w, spec.type_name, k).to(dtype)))
            else:
                groups.append((0, w))
        parts = []
        for n_planes, held in groups:
            if n_planes == 0:
                parts.append((held.shape[0], 0, held, None))
            else:
                packed, sz = _pack_rows(held, k)
                parts.append((packed.shape[0], n_planes, packed, sz))
        linear = cls(k, module.out_features, parts, module.bias)
        linear.source_types = source_types
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._single:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.reshape(-1, self.in_features).to(PACK_DTYPE), self.part0, GROUP, self.scales_zeros0)
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        inputs: dict[int, torch.Tensor] = {}
        ys = []
        for i, (_, n_planes) in enumerate(self.kinds):
            w = getattr(self, f"part{i}")
            if n_planes == 0:
                ys.append(F.linear(x2, w))
                continue
            if n_planes not in inputs:
                xb = x2.to(PACK_DTYPE)
                inputs[n_planes] = xb if n_planes == 1 else xb.repeat(1, n_planes)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(inputs[n_planes], w, GROUP, getattr(self, f"scales_zeros{i}"))
            ys.append(y.to(x.dtype))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        mix = ", ".join(f"{f'int4x{p}' if p else 'dense'}x{rows}" for rows, p in self.kinds)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{mix}]"


class QuantEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks (uint8 ``[vocab, K / block_elements *
    block_bytes]`` of a :data:`CODE_BITS` type, or a K-quant where the C kernels read the
    tied head): a lookup dequantizes only the rows it returns, so the table costs its file
    bytes (Q8_0: 34 per 32 weights, Q6_K 210 per 256) instead of float32's 128 per 32.

    ``forward(ids)``: int64 ``[T]`` -> ``[T, K]`` in ``dtype``, the same values as
    ``gguf``'s dequantizer (computed in float32)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.type_name = type_name
        self.embedding_dim = embedding_dim
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.type_name not in CODE_BITS:  # a K-quant (maybe interleaved): only where the C kernels run
            return c_blocks.dequantize_ids(cpu_kernels(), self.blocks, self.type_name, ids).to(self.dtype)
        rows = self.blocks.index_select(0, ids)
        return dequantize_rows(rows, self.type_name, self.embedding_dim, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.blocks.shape[0]}, {self.embedding_dim}, {self.type_name} blocks"


class RescoredHead(nn.Module):
    """A tied LM head: logits from the int4 matmul, then the ``top`` best of each row
    computed again in float32 from the embedding blocks.

    The int4 kernel returns bfloat16, whose step at a logit of 25 is 0.125: two tokens a
    few hundredths apart come out tied, and greedy decoding would pick by index. Scoring
    the candidates again (``top`` rows dequantized, one small matmul) restores float32
    logits where the choice is made; the rest of the vocabulary keeps bfloat16 logits,
    which move sampled probabilities by well under 1%.

    ``forward(h)``: ``[B, K]`` -> float32 ``[B, vocab]``.
    """

    def __init__(self, head: CpuInt4Linear, embeddings: QuantEmbedding, top: int = 16) -> None:
        super().__init__()
        self.head = head
        self.embeddings = embeddings  # shared with the model's lookup, not a copy
        self.top = top

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h).float()
        cand = logits.topk(min(self.top, logits.shape[-1]), dim=-1).indices  # [B, top]
        rows = self.embeddings(cand.reshape(-1)).float().view(*cand.shape, h.shape[-1])  # [B, top, K]
        exact = torch.einsum("bk,btk->bt", h.float(), rows)
        return logits.scatter_(-1, cand, exact)
