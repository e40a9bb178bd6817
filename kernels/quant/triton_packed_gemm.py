"""The block GEMM for the common GGUF types (Q4_K, Q5_K, Q6_K as its planes ``Q6_K_P``,
Q4_0, Q8_0) with bfloat16 rows: each weight decoded in a few instructions, in the
registers the tensor cores read.

Per group of 32 weights of K (one Q4_K or Q5_K sub-block; two Q6_K ones of 16), a row's
codes are 32 consecutive bytes: a Q4_K group's the low or high nibbles of one run of 32,
a Q5_K group's the same under one bit of each of the block's 32 ``qh`` bytes, a Q6_K_P
group's the nibbles of 32 bytes of ``ql`` ORed with two bits of 32 bytes of ``qh``
(ggml-common.h's layouts; :mod:`kernels.quant.repack` for the planes). One PTX sequence
(:func:`_q4_weights`, :func:`_q5_weights`, :func:`_q6_weights`) takes four codes of one
32-bit register:
masks the nibbles of all four at once, puts each code under the exponent byte of 128.0
(``prmt``: two bfloat16 ``128 + code`` a register, exact for codes below 128), subtracts
128 (exact) and multiplies by the group's scale plus its offset in one ``fma.rn.bf16x2``
(one rounding). So the weight is ``scale * code + offset`` with the scale and offset
rounded to bfloat16 (Q4_K, Q5_K: ``d * sc`` and ``-dmin * m``, ggml's ``get_scale_min_k4``;
Q6_K: ``d * sc`` and ``-32 d * sc``, exact given the scale), then rounded once more.
Triton keeps the decode after the shared-memory load, in the layout of ``tl.dot``'s
operand (checked in the sm_90 SASS: no store of the decoded tile), so the tile costs
its bytes' loads, about two instructions a weight and the tensor cores' product.

Q4_0's 32 codes are the low and high nibbles of 16 bytes (two products of depth 16);
Q8_0's signed bytes go through float16 exactly (``1024 + 128 + code`` under 1024's
exponent) and float32, where the block's float16 scale multiplies them exactly, then are
rounded once to bfloat16 (:func:`_q8_weights`: about four instructions a weight). The K-quants' scales come from one 12-byte read per row and block: the 6-bit
scales and mins of four sub-blocks sit one a byte in a 32-bit word (``0x3F3F3F3F``
masks, the high halves' top bits ORed in), so a group's are one byte shift away.

Against the float tile GEMM (:func:`kernels.quant.triton_kernel.quant_gemm`, about
eleven instructions a weight, one at a time in float32) it took 51.8 against 179.6 us for
the 8B shape's 28672 x 4096 Q4_K gate/up at 16 rows and 179.9 against 387.5 at 128 on an
H200 (docs/benchmarks.md); Q5_K, Q4_0 and Q8_0 equal gguf's dequantizer compiled on the
H200 too (tests/test_quant_gemm.py, tests/gpu/test_quant_gpu.py), not yet timed. Triton's interpreter runs no PTX: there the same decode runs in
float32 (and the product in IEEE float32), the tests' reference path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant.split_k import partials_at, split_k_ranges, split_output, sum_partials
from kernels.quant.triton_decode import (
    check_blocks,
    f16,
    gemm_tile,
    output_for,
    ptx_enabled,
    store_tile,
)

# The layouts it reads, with their format codes (kernels.quant.formats).
PACKED_TYPES = {"Q4_0": 0, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K_P": 8}


# Operands with pack=4: $0, $1 the four bfloat16 weights (two a register), then each
# argument: uint8 codes one register of four bytes, bfloat16 scales and offsets two
# registers (a pair each).


def _bf16_tail(src: str) -> str:
    """After ``src`` leaves four codes in ``[0, 128)`` in ``%q``, one a byte: bfloat16
    pairs ``128 + code`` (the code under 128.0's exponent byte, 0x43) in ``%a`` (codes
    0-1) and ``%b`` (2-3), minus 128."""
    return (src + " prmt.b32 %a, %q, 0x43434343, 0x4140; prmt.b32 %b, %q, 0x43434343, 0x4342;"
            " mov.b32 %c, 0x43004300; sub.rn.bf16x2 %a, %a, %c; sub.rn.bf16x2 %b, %b, %c;")


def _nibbles(high: int) -> str:
    """PTX for four Q4 weights: the low (``high`` 0) or high nibbles of the bytes of $2."""
    codes = "shr.u32 %q, $2, 4; and.b32 %q, %q, 0x0F0F0F0F;" if high else "and.b32 %q, $2, 0x0F0F0F0F;"
    return ("{ .reg .b32 %q, %a, %b, %c; " + _bf16_tail(codes)
            + " fma.rn.bf16x2 $0, %a, $3, $5; fma.rn.bf16x2 $1, %b, $4, $6; }")


def _q6(low_shift: int, high_shift: int) -> str:
    """PTX for four Q6_K weights: the nibbles of ``ql`` ($2) at ``low_shift`` ORed with
    the two bits of ``qh`` ($3) at ``high_shift`` moved to bits 4-5 of each byte."""
    move = f"shl.b32 %h, $3, {4 - high_shift};" if high_shift <= 4 else f"shr.u32 %h, $3, {high_shift - 4};"
    codes = (f"shr.u32 %q, $2, {low_shift}; and.b32 %q, %q, 0x0F0F0F0F; {move} and.b32 %h, %h, 0x30303030;"
             " or.b32 %q, %q, %h;")
    return ("{ .reg .b32 %q, %h, %a, %b, %c; " + _bf16_tail(codes)
            + " fma.rn.bf16x2 $0, %a, $4, $6; fma.rn.bf16x2 $1, %b, $5, $7; }")


def _q5(sub: int) -> str:
    """PTX for four Q5_K weights of sub-block ``sub`` (0-7): the nibbles of ``qs`` ($2),
    low for an even ``sub``, under bit ``sub`` of each byte of ``qh`` ($3) moved to bit 4."""
    move = f"shl.b32 %h, $3, {4 - sub};" if sub <= 4 else f"shr.u32 %h, $3, {sub - 4};"
    codes = (f"shr.u32 %q, $2, {4 * (sub % 2)}; and.b32 %q, %q, 0x0F0F0F0F; {move} and.b32 %h, %h, 0x10101010;"
             " or.b32 %q, %q, %h;")
    return ("{ .reg .b32 %q, %h, %a, %b, %c; " + _bf16_tail(codes)
            + " fma.rn.bf16x2 $0, %a, $4, $6; fma.rn.bf16x2 $1, %b, $5, $7; }")


# The decode strings, indexed inside the kernels by a compile-time constant: Q4 by the
# nibble (low, high), Q5_K by the sub-block of its block, Q6_K_P by the group of its
# half-block (0-1 the low nibbles of ql, 2-3 the high; bits 2g, 2g + 1 of qh).
_Q4 = tl.constexpr(tuple(_nibbles(high) for high in (0, 1)))
_Q5 = tl.constexpr(tuple(_q5(sub) for sub in range(8)))
_Q6 = tl.constexpr(tuple(_q6(4 * (g // 2), 2 * g) for g in range(4)))


@triton.jit
def _q4_weights(raw, scale, offset, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Weights ``[R, 32]``: ``scale * nibble + offset`` of the bytes ``raw`` (uint8
    ``[R, 32]``; low or high nibbles), ``scale``/``offset`` float32 ``[R, 1]``; bfloat16
    decoded in PTX with ``ASM``, else float32."""
    s = tl.broadcast_to(scale, raw.shape)
    o = tl.broadcast_to(offset, raw.shape)
    if ASM:
        w = tl.inline_asm_elementwise(_Q4[HIGH], "=r,=r,r,r,r,r,r", [raw, s.to(tl.bfloat16), o.to(tl.bfloat16)],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        q = ((raw.to(tl.int32) >> (4 * HIGH)) & 15).to(tl.float32)
        w = q * s + o
    return w


@triton.jit
def _q6_weights(ql, qh, scale, offset, G: tl.constexpr, ASM: tl.constexpr):
    """Weights ``[R, 32]`` of group ``G`` (0-3) of a Q6_K_P half-block: ``scale * code +
    offset``, the codes the nibbles of ``ql`` (low for ``G < 2``) under the bits ``2 G,
    2 G + 1`` of ``qh`` (uint8 ``[R, 32]`` each); bfloat16 with ``ASM``, else float32."""
    s = tl.broadcast_to(scale, ql.shape)
    o = tl.broadcast_to(offset, ql.shape)
    if ASM:
        w = tl.inline_asm_elementwise(_Q6[G], "=r,=r,r,r,r,r,r,r", [ql, qh, s.to(tl.bfloat16), o.to(tl.bfloat16)],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        q = (((ql.to(tl.int32) >> (4 * (G // 2))) & 15) | (((qh.to(tl.int32) >> (2 * G)) & 3) << 4)).to(tl.float32)
        w = q * s + o
    return w


@triton.jit
def _q5_weights(qs, qh, scale, offset, S: tl.constexpr, ASM: tl.constexpr):
    """Weights ``[R, 32]`` of Q5_K sub-block ``S`` (0-7): ``scale * code + offset``, the
    codes the nibbles of ``qs`` (low for an even ``S``) under bit ``S`` of ``qh`` (uint8
    ``[R, 32]`` each); bfloat16 with ``ASM``, else float32."""
    s = tl.broadcast_to(scale, qs.shape)
    o = tl.broadcast_to(offset, qs.shape)
    if ASM:
        w = tl.inline_asm_elementwise(_Q5[S], "=r,=r,r,r,r,r,r,r", [qs, qh, s.to(tl.bfloat16), o.to(tl.bfloat16)],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        q = (((qs.to(tl.int32) >> (4 * (S % 2))) & 15) | (((qh.to(tl.int32) >> S) & 1) << 4)).to(tl.float32)
        w = q * s + o
    return w


# Q8_0: four signed codes a register, each + 128 put under float16 1024's exponent
# (``1024 + 128 + code``), 1152 subtracted (exact), widened to float32 and multiplied by
# its own weight's float16 scale there (exact: 8 by 11 bits), then rounded once to
# bfloat16. Each weight takes its own scale ($3 holds weights 0-1's, $4 weights 2-3's):
# the four elements of a pack can lie in different weight rows (Triton may pack along N
# in the layout it picks for the dot operand), so one scale for the pack is wrong.
_Q8 = tl.constexpr(
    "{ .reg .b32 %q, %a, %b, %c; .reg .b16 %h<8>; .reg .f32 %f<8>;"
    " xor.b32 %q, $2, 0x80808080; prmt.b32 %a, %q, 0x64646464, 0x4140; prmt.b32 %b, %q, 0x64646464, 0x4342;"
    " mov.b32 %c, 0x64806480; sub.rn.f16x2 %a, %a, %c; sub.rn.f16x2 %b, %b, %c;"
    " mov.b32 {%h0, %h1}, %a; mov.b32 {%h2, %h3}, %b; mov.b32 {%h4, %h5}, $3; mov.b32 {%h6, %h7}, $4;"
    " cvt.f32.f16 %f0, %h0; cvt.f32.f16 %f1, %h1; cvt.f32.f16 %f2, %h2; cvt.f32.f16 %f3, %h3;"
    " cvt.f32.f16 %f4, %h4; cvt.f32.f16 %f5, %h5; cvt.f32.f16 %f6, %h6; cvt.f32.f16 %f7, %h7;"
    " mul.rn.f32 %f0, %f0, %f4; mul.rn.f32 %f1, %f1, %f5; mul.rn.f32 %f2, %f2, %f6; mul.rn.f32 %f3, %f3, %f7;"
    " cvt.rn.bf16x2.f32 $0, %f1, %f0; cvt.rn.bf16x2.f32 $1, %f3, %f2; }")


@triton.jit
def _q8_weights(raw, d, ASM: tl.constexpr):
    """Weights ``[R, 32]``: ``d * code`` of the int8 codes ``raw`` (uint8 ``[R, 32]``),
    ``d`` float16 ``[R, 1]`` (Q8_0's scale as stored); bfloat16 decoded in PTX with
    ``ASM`` (the product rounded once, as the float tile GEMM rounds it), else float32."""
    s = tl.broadcast_to(d, raw.shape)
    if ASM:
        w = tl.inline_asm_elementwise(_Q8, "=r,=r,r,r,r", [raw, s], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        w = raw.to(tl.int8, bitcast=True).to(tl.float32) * s.to(tl.float32)
    return w


@triton.jit
def _dot(x, w, acc, ASM: tl.constexpr):
    """``acc + x @ w.T`` on tensor cores: bfloat16 with ``ASM``, else (the interpreter,
    which mis-converts tiles to bfloat16 before a dot) float32."""
    if ASM:
        acc = tl.dot(x, tl.trans(w), acc)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return acc


# Blocks of the 32-weight formats a loop step (four Q4_0 ones spilled registers on sm_90
# at 32 x 128); K ranges of a split are whole steps (:func:`packed_gemm`).
Q4_0_STEP = tl.constexpr(2)
Q8_0_STEP = tl.constexpr(4)


@triton.jit
def _packed_dot32(x_row, live, rp, kb_begin, kb_end, QT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """:func:`packed_dot` for the 32-weight formats (Q4_0 18 bytes a block: ``d``, 16
    bytes of nibbles, low ones the weights 0-15; Q8_0 34 bytes: ``d``, 32 int8 codes),
    :data:`Q8_0_STEP` or :data:`Q4_0_STEP` blocks a step, the blocks past ``kb_end`` read
    from the last one and meeting zeroed activations."""
    BB: tl.constexpr = 18 if QT == 0 else 34
    STEP: tl.constexpr = Q4_0_STEP if QT == 0 else Q8_0_STEP
    e = tl.max_contiguous(tl.arange(0, 32), 32)[None, :]
    e16 = tl.max_contiguous(tl.arange(0, 16), 16)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb0 in range(kb_begin, kb_end, STEP):
        for j in tl.static_range(STEP):
            kb = tl.minimum(kb0 + j, kb_end - 1)
            on = live[:, None] & ((kb0 + j + tl.zeros([1, 1], tl.int32)) < kb_end)
            blk = rp + kb * BB
            xp = x_row + kb * 32
            if QT == 0:
                raw = tl.load(blk + 2 + e16)  # [BLOCK_N, 16]
                d = f16(blk)
                acc = _dot(tl.load(xp + e16, mask=on, other=0.0), _q4_weights(raw, d, -8.0 * d, 0, ASM), acc, ASM)
                acc = _dot(tl.load(xp + 16 + e16, mask=on, other=0.0), _q4_weights(raw, d, -8.0 * d, 1, ASM), acc,
                           ASM)
            else:
                d = tl.load((blk).to(tl.pointer_type(tl.float16)))
                acc = _dot(tl.load(xp + e, mask=on, other=0.0), _q8_weights(tl.load(blk + 2 + e), d, ASM), acc, ASM)
    return acc


@triton.jit
def _byte_f32(word, B: tl.constexpr):
    """Byte ``B`` of int32 ``word`` as float32."""
    return ((word >> (8 * B)) & 0xFF).to(tl.float32)


@triton.jit
def packed_dot(x_row, live, rp, kb_begin, kb_end, NB, QT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` float32: the activation rows at ``x_row`` (``[BLOCK_M, 1]``
    pointers, ``live`` the rows that exist) times the weight rows at ``rp`` (``[BLOCK_N,
    1]`` uint8 pointers to each row's first block, ``NB`` blocks a row, laid out as
    ``QT``'s) over blocks ``kb_begin .. kb_end - 1``: each group of 32 weights decoded
    (:func:`_q4_weights`, :func:`_q5_weights`, :func:`_q6_weights`) and multiplied on
    tensor cores. Shared by :func:`packed_gemm` and the fused MoE's sorted GEMM
    (:mod:`kernels.moe.quant_triton_kernel`)."""
    if QT == 0 or QT == 4:
        return _packed_dot32(x_row, live, rp, kb_begin, kb_end, QT, BLOCK_M, BLOCK_N, ASM)
    e = tl.max_contiguous(tl.arange(0, 32), 32)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if QT == 5:
        blk = rp + kb_begin * 144
    elif QT == 6:
        blk = rp + kb_begin * 176
    else:
        ql = rp + kb_begin * 128
        qh = rp + NB * 128 + kb_begin * 64
        scp = rp + NB * 192 + kb_begin * 16
        dp = rp + NB * 208 + kb_begin * 2
    xp = x_row + kb_begin * 256 + e
    for _ in range(kb_begin, kb_end):  # the pointers advance a block a step
        if QT == 6:
            qh5 = tl.load(blk + 16 + e)  # the high bits of every sub-block: bit S of byte t
        if QT == 5 or QT == 6:
            words = (blk + 4).to(tl.pointer_type(tl.int32))
            w1 = tl.load(words)
            w2 = tl.load(words + 1)
            w3 = tl.load(words + 2)
            d = f16(blk)
            dmin = -f16(blk + 2)
        else:
            sc_words = scp.to(tl.pointer_type(tl.int32))
            d = f16(dp)
        for h in tl.static_range(2):
            if QT == 5 or QT == 6:
                if h == 0:
                    sc4 = w1 & 0x3F3F3F3F
                    mn4 = w2 & 0x3F3F3F3F
                else:
                    sc4 = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)
                    mn4 = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
            else:
                qhh = tl.load(qh + h * 32 + e)
                s_a = tl.load(sc_words + 2 * h)
                s_b = tl.load(sc_words + 2 * h + 1)
            for i in tl.static_range(4):
                x = tl.load(xp + (h * 128 + i * 32), mask=live[:, None], other=0.0)  # [BLOCK_M, 32]
                if QT == 5:
                    if i % 2 == 0:
                        raw = tl.load(blk + 16 + h * 64 + (i // 2) * 32 + e)
                    w = _q4_weights(raw, d * _byte_f32(sc4, i), dmin * _byte_f32(mn4, i), i % 2, ASM)
                elif QT == 6:
                    if i % 2 == 0:
                        raw = tl.load(blk + 48 + h * 64 + (i // 2) * 32 + e)
                    w = _q5_weights(raw, qh5, d * _byte_f32(sc4, i), dmin * _byte_f32(mn4, i), 4 * h + i, ASM)
                else:
                    if i < 2:
                        raw = tl.load(ql + h * 64 + 32 * i + e)
                        if i == 0:
                            raw0 = raw
                        else:
                            raw1 = raw
                    word = s_a if i < 2 else s_b
                    sc0 = ((word << (24 - 16 * (i % 2))) >> 24).to(tl.float32)
                    sc1 = ((word << (16 - 16 * (i % 2))) >> 24).to(tl.float32)
                    scale = d * tl.where(e < 16, sc0, sc1)
                    w = _q6_weights(raw0 if i % 2 == 0 else raw1, qhh, scale, scale * -32.0, i, ASM)
                acc = _dot(x, w, acc, ASM)
        xp += 256
        if QT == 5:
            blk += 144
        elif QT == 6:
            blk += 176
        else:
            ql += 128
            qh += 64
            scp += 16
            dp += 2
    return acc


@triton.jit
def _packed_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, blocks_per_split, stride_xm, stride_om,
    QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS: tl.constexpr, ASM: tl.constexpr,
):
    rows, row_ptr, ms, m_mask, pid_k = gemm_tile(w_ptr, M, N, row_bytes, BLOCK_M, BLOCK_N)
    x_row = x_ptr + tl.minimum(ms, M - 1).to(tl.int64)[:, None] * stride_xm
    rp = row_ptr[:, None]
    NB = K // (32 if QT == 0 or QT == 4 else 256)
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, NB)
    acc = packed_dot(x_row, m_mask, rp, kb_begin, kb_end, NB, QT, BLOCK_M, BLOCK_N, ASM)
    store_tile(partials_at(out_ptr, pid_k, M, stride_om, PARTIALS), acc, rows, ms, m_mask, N, stride_om)


def packed_gemm(x: torch.Tensor, blocks: torch.Tensor, type_name: str, *, block_m: int = 16, block_n: int = 64,
                num_warps: int = 4, num_stages: int = 2, split_k: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``W`` in blocks of one of :data:`PACKED_TYPES` (module docstring).

    Args:
        x: ``[M, K]`` bfloat16 on CUDA (any float dtype in Triton's interpreter), unit
            column stride, ``K`` a multiple of the format's block (32 or 256 weights).
        blocks: uint8 ``[N, K / block_elements * block_bytes]``, the weight in
            ``type_name``'s layout.
        type_name: a key of :data:`PACKED_TYPES`.
        block_m, block_n: rows of ``x`` and of ``W`` a program, powers of two >= 16.
        num_warps, num_stages: Triton's launch options.
        split_k: K ranges (default: four programs per SM), their float32 partial sums
            added in a fixed order (:mod:`kernels.quant.split_k`).
        out: where to write ``[M, N]`` (``x.dtype``), else a new tensor.

    Returns:
        ``[M, N]`` in ``x.dtype``, accumulated in float32.

    Raises:
        ValueError: a type not in :data:`PACKED_TYPES`; shapes that do not match; K-quant
            rows not 4-byte aligned (the scales are read as 32-bit words: a Q6_K_P row of
            an odd number of blocks); tile sizes that are not powers of two >= 16.
    """
    if type_name not in PACKED_TYPES:
        raise ValueError(f"the packed GEMM reads {', '.join(PACKED_TYPES)}, not {type_name}")
    fmt, k = check_blocks(x, blocks, type_name)
    asm = ptx_enabled(x.device)
    if asm and x.dtype != torch.bfloat16:
        raise ValueError(f"the packed GEMM multiplies bfloat16 rows on CUDA, got {x.dtype}")
    if fmt.block_elements == 256 and (blocks.stride(0) % 4 or blocks.data_ptr() % 4):
        raise ValueError(f"the packed GEMM reads {type_name} rows 4-byte aligned: row stride {blocks.stride(0)} bytes")
    if min(block_m, block_n) < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m and block_n must be powers of two >= 16, got {block_m} and {block_n}")
    m, n = x.shape[0], blocks.shape[0]
    nblocks = k // fmt.block_elements
    result = output_for(x, n, out)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # K ranges of whole loop steps (the 32-weight formats take 2 or 4 blocks a step).
    step = {"Q4_0": Q4_0_STEP.value, "Q8_0": Q8_0_STEP.value}.get(type_name, 1)
    per_split, split = split_k_ranges(nblocks, step, tiles, x.device, split_k)
    per_split = triton.cdiv(per_split, step) * step
    split = triton.cdiv(nblocks, per_split)
    dest = split_output(result, split)
    _packed_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        x, blocks, dest, m, n, k, blocks.stride(0), per_split, x.stride(0), dest.stride(-2),
        QT=PACKED_TYPES[type_name], BLOCK_M=block_m, BLOCK_N=block_n, PARTIALS=split > 1,
        ASM=asm, num_warps=num_warps, num_stages=num_stages,
    )
    return sum_partials(result, dest)
