"""The Triton decoding of GGUF blocks that every block kernel shares: a block's codes,
scales and offsets (ggml-common.h's layouts, decoded as ``gguf.quants`` does), and the
two K loops built on them, :func:`gemv_dot` (one activation row against a tile of
weight rows, in registers) and :func:`gemm_dot` (a tile of rows on tensor cores). The
dense kernels (:mod:`kernels.quant.triton_kernel`), the fused MoE over blocks
(:mod:`kernels.moe.quant_triton_kernel`) and the int8 GEMV
(:mod:`kernels.quant.triton_int8`) call them; the host-side checks and launch
arguments they share are here too.

The GEMV rounds no weight to 16 bits; the GEMM's tiles round the decoded weights to the
activations' dtype before the tensor cores (:func:`gemm_dot_range`). Codes become floats without an int-to-float
instruction: ORed into the mantissa of 2**23 (:func:`_codes_f32`; for Q4_K and Q8_0
four codes at a time in PTX, :func:`_codes_fast`, unless the ``quant_ptx`` switch of
:mod:`kernels.switches` is off); each format's zero point (Q4_0's 8, Q6_K's 32, ...) is
subtracted there, so only formats with a min pay ``offset * sum(x)``.

A sub-block is ``L`` consecutive weights of one row that share a scale and an offset
(:mod:`kernels.quant.formats`): the decoder gives its codes, scale and offset with
``w = scale * (code - zero) + offset``, read straight from the block bytes as ggml lays
them out. Out-of-range rows are clamped to the last row (their loads stay in bounds,
their stores are masked); blocks past a program's range are loaded from its last block
and multiplied by zeroed activations.
"""

from __future__ import annotations

import os
from typing import TypedDict

import torch
import triton
import triton.language as tl

from kernels.quant.formats import block_format
from kernels.quant.split_k import sm_count
from kernels.switches import current

# Triton's interpreter mis-converts a float32 tile to bfloat16 before ``tl.dot`` (the
# product comes out as garbage), so there the kernels multiply in float32 whatever the
# activations' dtype; and it runs no PTX.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def ptx_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` convert codes with inline PTX (:func:`_codes_fast`,
    the int8 GEMV's ``dp4a``): compiled for CUDA, and the ``quant_ptx`` switch on (read
    at each launch)."""
    return device.type == "cuda" and not INTERPRETING and current().quant_ptx


@triton.jit
def f16(ptr):
    """float32 of the little-endian float16 at ``ptr`` (uint8 pointers of any shape; every
    block keeps its float16 fields at even offsets of an even-sized block, so the cast
    pointer is aligned)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _k_scale_min(blk, S):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block ``S`` (constexpr or a tensor) from
    the 12 packed bytes at ``blk + 4`` (ggml's ``get_scale_min_k4``). Both halves'
    formulas are evaluated (their loads stay inside the block) and one is selected, so a
    runtime ``S`` needs no branch."""
    low = tl.load(blk + 4 + S).to(tl.int32)
    packed = tl.load(blk + 8 + S).to(tl.int32)
    sc = tl.where(S < 4, low & 63, (packed & 15) | ((tl.load(blk + S).to(tl.int32) >> 6) << 4))
    mn = tl.where(S < 4, packed & 63, (packed >> 4) | ((low >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _codes(b, tt, QT: tl.constexpr, S):
    """int32 codes in ``[0, 256)`` of element ``tt`` of sub-block ``S`` of the blocks at
    ``b`` (uint8 pointers; the three broadcast together, e.g. ``b`` ``[R, 1, 1]``,
    ``S`` ``[1, NSUB, 1]``, ``tt`` ``[1, 1, L]``). The weight is
    ``scale * (code - _ZERO[QT]) + offset`` (:func:`_scales`). Layouts as ggml's
    ``block_q4_0`` ... ``block_q6_K`` and ``block_mxfp4``."""
    if QT == 0:  # Q4_0: d, 16 bytes of nibbles (low: weights 0-15, high: 16-31)
        u = (tl.load(b + 2 + tt).to(tl.int32) >> (4 * S)) & 15
    elif QT == 1:  # Q4_1: d, m, nibbles
        u = (tl.load(b + 4 + tt).to(tl.int32) >> (4 * S)) & 15
    elif QT == 2:  # Q5_0: d, 32 high bits, nibbles
        hb = (tl.load(b + 2 + 2 * S + tt // 8).to(tl.int32) >> (tt % 8)) & 1
        u = ((tl.load(b + 6 + tt).to(tl.int32) >> (4 * S)) & 15) | (hb << 4)
    elif QT == 3:  # Q5_1: d, m, 32 high bits, nibbles
        hb = (tl.load(b + 4 + 2 * S + tt // 8).to(tl.int32) >> (tt % 8)) & 1
        u = ((tl.load(b + 8 + tt).to(tl.int32) >> (4 * S)) & 15) | (hb << 4)
    elif QT == 4:  # Q8_0: d, 32 int8 (sign bit flipped: offset binary)
        u = tl.load(b + 2 + tt).to(tl.int32) ^ 128
    elif QT == 5:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles in 4 runs of 32
        u = (tl.load(b + 16 + (S // 2) * 32 + tt).to(tl.int32) >> (4 * (S % 2))) & 15
    elif QT == 6:  # Q5_K: as Q4_K, plus 32 bytes of high bits (bit S of byte t)
        hb = (tl.load(b + 16 + tt).to(tl.int32) >> S) & 1
        u = ((tl.load(b + 48 + (S // 2) * 32 + tt).to(tl.int32) >> (4 * (S % 2))) & 15) | (hb << 4)
    elif QT == 9:  # MXFP4: E8M0 scale byte, 16 bytes of E2M1 nibbles (low: weights 0-15, high: 16-31)
        u = _e2m1_doubled(tl.load(b + 1 + tt).to(tl.int32) >> (4 * S)) + 16
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d
        lo = (tl.load(b + (S // 8) * 64 + 16 * (S % 4) + tt).to(tl.int32) >> (4 * ((S // 4) % 2))) & 15
        hi = (tl.load(b + 128 + (S // 8) * 32 + 16 * (S % 2) + tt).to(tl.int32) >> (2 * ((S // 2) % 4))) & 3
        u = lo | (hi << 4)
    return u


@triton.jit
def _e2m1_doubled(nibble):
    """Twice the E2M1 value of the low 4 bits of ``nibble`` (int32; sign bit highest), an
    integer in ``[-12, 12]``: gguf's ``MXFP4.kvalues`` (0, 1, 2, 3, 4, 6, 8, 12 and their
    negatives), computed rather than looked up (magnitudes 4-7 are ``(2 + m % 2) << (m // 2 - 1)``)."""
    m = nibble & 7
    mag = tl.where(m < 4, m, (2 + (m & 1)) << (tl.maximum(m >> 1, 1) - 1))
    return tl.where((nibble & 8) != 0, -mag, mag)


@triton.jit
def _e8m0_half(e):
    """float32 ``2 ** (e - 128)`` of E8M0 exponents ``e`` (int32 in ``[0, 256)``), built from
    its bits as ggml's ``ggml_e8m0_to_fp32_half`` (the two smallest subnormal)."""
    return tl.where(e < 2, (e * 0 + 0x00200000) << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scales(b, QT: tl.constexpr, S):
    """``(scale, offset)`` float32 of sub-block ``S`` of the blocks at ``b`` (broadcast
    together, e.g. ``[R, 1]`` and ``[1, NSUB]``; kept apart from :func:`_codes` so the
    scales live once per thread, not once per weight). ``offset`` is the min's share,
    zero for the formats without one (Q4_0, Q5_0, Q8_0, Q6_K: their offset is a whole
    number of scales, folded into the codes' zero point)."""
    if QT == 1 or QT == 3:  # Q4_1, Q5_1: d, m
        scale = f16(b) + 0.0 * S
        offset = f16(b + 2) + 0.0 * S
    elif QT == 5 or QT == 6:  # Q4_K, Q5_K: d, dmin, 6-bit scales and mins
        sc, mn = _k_scale_min(b, S)
        scale = f16(b) * sc
        offset = -f16(b + 2) * mn
    elif QT == 9:  # MXFP4: the E8M0 byte e, halved (the codes are doubled E2M1 values)
        scale = _e8m0_half(tl.load(b).to(tl.int32)) + 0.0 * S
        offset = scale * 0.0
    elif QT == 7:  # Q6_K: int8 scales at 192, d at 208
        scale = f16(b + 208) * tl.load(b + 192 + S).to(tl.int8, bitcast=True).to(tl.float32)
        offset = scale * 0.0
    else:  # Q4_0, Q5_0, Q8_0: d
        scale = f16(b) + 0.0 * S
        offset = scale * 0.0
    return scale, offset


@triton.jit
def _codes_f32(u, ZERO: tl.constexpr):
    """``u - ZERO`` as float32 for codes ``0 <= u < 2**23``, without an int-to-float
    conversion (a quarter-rate instruction on Hopper): ``u`` ORed into the mantissa of
    2**23 is the float ``2**23 + u`` exactly, and the subtraction is exact too."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + ZERO)


@triton.jit
def _q6p_fields(row, kb, NB):
    """Q6_K_P (:mod:`kernels.quant.repack`): pointers to block ``kb``'s ``ql``, ``qh``,
    scales and ``d`` in the row at ``row`` of ``NB`` blocks (uint8 pointers; broadcast)."""
    return row + kb * 128, row + NB * 128 + kb * 64, row + NB * 192 + kb * 16, row + NB * 208 + kb * 2


@triton.jit
def _q6p_codes(ql, qh, tt, S):
    """Q6_K_P codes in ``[0, 64)`` of element ``tt`` of sub-block ``S``: Q6_K's decoding
    (:func:`_codes`) over the block's ``ql`` and ``qh`` planes."""
    lo = (tl.load(ql + (S // 8) * 64 + 16 * (S % 4) + tt).to(tl.int32) >> (4 * ((S // 4) % 2))) & 15
    hi = (tl.load(qh + (S // 8) * 32 + 16 * (S % 2) + tt).to(tl.int32) >> (2 * ((S // 2) % 4))) & 3
    return lo | (hi << 4)


@triton.jit
def _q6p_scale(sc, dp, S):
    """Q6_K_P: the float32 scale of sub-block ``S`` (``d`` times its int8 scale)."""
    return f16(dp) * tl.load(sc + S).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def block_sub(row, kb, NB, t, QT: tl.constexpr, BB: tl.constexpr, S, ZERO: tl.constexpr):
    """``(q, scale, offset)`` of sub-block ``S`` of block ``kb`` of the rows at ``row``
    (``[R]`` pointers, ``NB`` blocks a row; ``t`` the sub-block's element range): as
    :func:`_sub_block`, for GGUF blocks and repacked layouts alike."""
    if QT == 8:
        ql, qh, sc, dp = _q6p_fields(row, kb, NB)
        scale = _q6p_scale(sc, dp, S)
        q = _codes_f32(_q6p_codes(ql[:, None], qh[:, None], t[None, :], S), ZERO)
        return q, scale, scale * 0.0
    return _sub_block(row + kb * BB, t, QT, S, ZERO)


# Four codes of one 32-bit register to four float32 ``2**23 + code`` (PTX): ``prmt``
# puts code byte i under the exponent bytes of 2**23 (0x4B000000), one instruction a
# weight; the masks and shifts before it work on all four bytes at once. Operands with
# pack=4: $0-$3 the floats, then each argument (8-bit: one register of four bytes,
# 32-bit: four registers).
_PRMT4 = """
    mov.b32 %m, 0x4B000000;
    prmt.b32 $0, %t, %m, 0x7650;
    prmt.b32 $1, %t, %m, 0x7651;
    prmt.b32 $2, %t, %m, 0x7652;
    prmt.b32 $3, %t, %m, 0x7653;
"""
_NIBBLES_ASM = tl.constexpr("{ .reg .b32 %t, %m; shr.u32 %t, $4, $5; and.b32 %t, %t, 0x0F0F0F0F;" + _PRMT4 + "}")
_SIGNED_ASM = tl.constexpr("{ .reg .b32 %t, %m; xor.b32 %t, $4, 0x80808080;" + _PRMT4 + "}")


@triton.jit
def _codes_fast(b, tt, QT: tl.constexpr, S, ZERO: tl.constexpr, ASM: tl.constexpr):
    """``code - ZERO`` as float32, as :func:`_codes_f32` of :func:`_codes`, through PTX
    that converts four codes of one register at a time for Q4_K and Q8_0 (``ASM``:
    compiled for CUDA; the interpreter runs no PTX). Only there: the nibble shift is
    taken once per four codes, right where a thread's runs of codes stay inside one
    sub-block (Q4_K's 32, its 16-byte aligned blocks); the 16-weight sub-blocks'
    layouts pack codes of two sub-blocks into one register (measured wrong on the
    H200), and for Q6_K the conversion measured no faster."""
    if ASM and QT == 5:
        raw = tl.load(b + 16 + (S // 2) * 32 + tt)
        f = tl.inline_asm_elementwise(_NIBBLES_ASM, "=r,=r,=r,=r,r,r,r,r,r", [raw, (4 * (S % 2) + 0 * tt).to(tl.int32)],
                                      dtype=tl.float32, is_pure=True, pack=4) - 8388608.0
    elif ASM and QT == 4:
        f = tl.inline_asm_elementwise(_SIGNED_ASM, "=r,=r,=r,=r,r", [tl.load(b + 2 + tt)],
                                      dtype=tl.float32, is_pure=True, pack=4) - (8388608.0 + ZERO)
    else:
        f = _codes_f32(_codes(b, tt, QT, S), ZERO)
    return f


@triton.jit
def _sub_block(blk, t, QT: tl.constexpr, S, ZERO: tl.constexpr):
    """Sub-block ``S`` (constexpr or runtime) of the blocks at ``blk`` (``[BLOCK_N]``
    pointers, one per row): ``(q [BLOCK_N, L] float32, scale [BLOCK_N], offset [BLOCK_N])``,
    weights ``scale * q + offset``, the codes ``q`` small integers (exact in bfloat16);
    ``t`` is ``tl.arange(0, L)``."""
    scale, offset = _scales(blk, QT, S)
    return _codes_f32(_codes(blk[:, None], t[None, :], QT, S), ZERO), scale, offset


@triton.jit
def gemv_dot(
    x_row, row_ptr, kb_begin, kb_end, NB,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr,
):
    """``[BLOCK_N]`` float32: the activation row at ``x_row`` times the weight rows at
    ``row_ptr`` (``[1, 1, BLOCK_N]`` pointers to each row's first block; ``NB`` blocks a
    row) over blocks ``kb_begin .. kb_end - 1``.

    The tile is [KB, NSUB, BLOCK_N, L]: KB blocks of K x each block's NSUB sub-blocks x
    rows x the sub-block's L weights. Threads spread over blocks and sub-blocks first
    (the rows' dimension comes last in the layout's order), so a thread holds the same L
    weights of several rows and the activations, one [KB, NSUB, 1, L] tile, are loaded,
    converted and summed once for all of them. Each sub-block's codes times the
    activations are summed in registers and scaled once."""
    kbi = tl.arange(0, KB)[:, None, None]
    S = tl.arange(0, NSUB)[None, :, None]  # [1, NSUB, 1]
    # Runs of 8 for the code bytes as for the bfloat16 activations (16-byte loads):
    # both loads then take one layout, with no shuffle of the codes between them.
    t = tl.max_contiguous(tl.arange(0, L), 8)[None, None, None, :]
    acc = tl.zeros([KB, NSUB, BLOCK_N], tl.float32)
    for kb0 in range(kb_begin, kb_end, KB):
        kb = kb0 + kbi  # [KB, 1, 1]
        live = (kb < kb_end)[:, :, :, None]
        kb = tl.minimum(kb, kb_end - 1)
        if QT == 8:
            ql, qh, sc, dp = _q6p_fields(row_ptr, kb, NB)  # [KB, 1, BLOCK_N]
            scale = _q6p_scale(sc, dp, S)  # [KB, NSUB, BLOCK_N]
            offset = scale * 0.0
            q = _codes_f32(_q6p_codes(ql[:, :, :, None], qh[:, :, :, None], t, S[:, :, :, None]), ZERO)
        else:
            blk = row_ptr + kb * BB  # [KB, 1, BLOCK_N]
            scale, offset = _scales(blk, QT, S)  # [KB, NSUB, BLOCK_N]
            q = _codes_fast(blk[:, :, :, None], t, QT, S[:, :, :, None], ZERO, ASM)  # [KB, NSUB, BLOCK_N, L]
        xv = tl.load(x_row + (kb * QK + S * L)[:, :, :, None] + t, mask=live, other=0.0).to(tl.float32)
        acc += tl.sum(q * xv, axis=3) * scale
        if HAS_MIN:
            acc += tl.sum(xv, axis=3) * offset
    return tl.sum(tl.sum(acc, axis=1), axis=0)


@triton.jit
def gemm_dot(
    x_row, m_mask, row_ptr, nblocks,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    SUBS: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` float32: the activation rows at ``x_row`` (``[BLOCK_M, 1]``
    pointers, ``m_mask`` the live ones) times the weight rows at ``row_ptr``
    (``[BLOCK_N]`` pointers) over all ``nblocks`` blocks (:func:`gemm_dot_range`)."""
    return gemm_dot_range(x_row, m_mask, row_ptr, 0, nblocks, nblocks, QT, QK, BB, L, NSUB, ZERO, HAS_MIN,
                          BLOCK_M, BLOCK_N, IEEE, SUBS)


@triton.jit
def gemm_dot_range(
    x_row, m_mask, row_ptr, kb_begin, kb_end, nblocks,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    SUBS: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` float32: as :func:`gemm_dot` over blocks ``kb_begin ..
    kb_end - 1`` of the ``nblocks`` a row holds (a split-K program's range).

    The K loop takes ``SUBS`` sub-blocks a step (a Q4_K block's 8 sub-blocks are 256
    weights; 8 Q4_0 blocks alike): their weights are decoded into registers, ``w =
    scale * q + offset`` ([BLOCK_N, SUBS, L] float32, then the activations' dtype: a
    weight is rounded to bfloat16 as a dequantized bfloat16 model's is), laid flat as
    ``[BLOCK_N, SUBS * L]`` in K's own order and multiplied on tensor cores into the
    accumulator, one ``tl.dot`` of depth ``SUBS * L``. The decode costs the same whatever
    ``BLOCK_M``, so the weights are read and decoded once for all the tile's rows.
    (Scaling the codes' product instead, which keeps codes exact, costs a ``[BLOCK_M,
    BLOCK_N]`` multiply-add per sub-block on the CUDA cores, more than the tensor cores'
    product itself at 16-32 weights a sub-block.) Sub-blocks past ``kb_end`` are loaded
    from the last one and meet zeroed activations."""
    sub = tl.arange(0, SUBS)[None, :]  # [1, SUBS]
    t = tl.arange(0, L)[None, None, :]  # [1, 1, L]
    k = tl.arange(0, SUBS * L)[None, :]
    rows = row_ptr[:, None]  # [BLOCK_N, 1]
    last = kb_end * NSUB - 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sb0 in range(kb_begin * NSUB, kb_end * NSUB, SUBS):
        sb = tl.minimum(sb0 + sub, last)
        kb = sb // NSUB
        s = sb % NSUB
        if QT == 8:
            ql, qh, sc, dp = _q6p_fields(rows, kb, nblocks)  # [BLOCK_N, SUBS]
            scale = _q6p_scale(sc, dp, s)
            q = _codes_f32(_q6p_codes(ql[:, :, None], qh[:, :, None], t, s[:, :, None]), ZERO)
            w = q * scale[:, :, None]
        else:
            blk = rows + kb * BB  # [BLOCK_N, SUBS]
            scale, offset = _scales(blk, QT, s)
            w = _codes_f32(_codes(blk[:, :, None], t, QT, s[:, :, None]), ZERO) * scale[:, :, None]
            if HAS_MIN:
                w += offset[:, :, None]
        w = tl.reshape(w, [BLOCK_N, SUBS * L])
        xv = tl.load(x_row + sb0 * L + k, mask=m_mask[:, None] & (sb0 * L + k < kb_end * QK), other=0.0)
        acc = _weights_dot(xv, w, acc, IEEE)
    return acc


@triton.jit
def gemm_tile(w_ptr, M, N, row_bytes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The output tile of a GEMM program on grid ``(M tiles, N tiles, K ranges)``:
    ``(rows [BLOCK_N], row_ptr [BLOCK_N], ms [BLOCK_M], m_mask, pid_k)``, the weight
    rows (pointers clamped to the last row) and activation rows it owns and its K
    range."""
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, row_ptr, ms, ms < M, tl.program_id(2)


@triton.jit
def store_tile(out_ptr, acc, rows, ms, m_mask, N, stride_om):
    """Write a GEMM program's float32 ``acc`` ``[BLOCK_M, BLOCK_N]`` at (``ms``, ``rows``)
    of ``out_ptr`` in its dtype (a K range's plane: :func:`~kernels.quant.split_k.partials_at`)."""
    out = out_ptr + ms[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (rows[None, :] < N))


@triton.jit
def _weights_dot(xv, w, acc, IEEE: tl.constexpr):
    """``acc + xv [BLOCK_M, L] @ w.T`` ([BLOCK_N, L] float32 weights) on tensor cores, in
    the activations' 16-bit type (float32 with ``IEEE``)."""
    if IEEE:
        return tl.dot(xv.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return tl.dot(xv, tl.trans(w.to(xv.dtype)), acc)


def check_blocks(x: torch.Tensor, blocks: torch.Tensor, type_name: str):
    fmt = block_format(type_name)
    if x.dim() != 2 or blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(f"want x [M, K] and uint8 blocks [N, bytes], got {tuple(x.shape)} and {blocks.dtype} {tuple(blocks.shape)}")
    k = x.shape[1]
    if k % fmt.block_elements or blocks.shape[1] != k // fmt.block_elements * fmt.block_bytes:
        raise ValueError(f"{type_name} blocks {tuple(blocks.shape)} do not hold rows of K={k} weights")
    if x.stride(1) != 1 or blocks.stride(1) != 1:
        raise ValueError("x and blocks need a contiguous last dimension")
    return fmt, k


# Per format code: the zero point folded into the codes (Q4_0's -8, Q5_0's -16, Q8_0's
# sign flip, Q6_K's -32; MXFP4's doubled E2M1 values, offset by 16 to stay non-negative)
# and whether the weight has a min (an offset per sub-block).
_ZERO = {0: 8, 1: 0, 2: 16, 3: 0, 4: 128, 5: 0, 6: 0, 7: 32, 8: 32, 9: 16}
_HAS_MIN = {0: False, 1: True, 2: False, 3: True, 4: False, 5: True, 6: True, 7: False, 8: False, 9: False}


def layout_constexprs(fmt) -> dict:
    return dict(QT=fmt.code, QK=fmt.block_elements, BB=fmt.block_bytes, L=fmt.sub_elements, NSUB=fmt.subs_per_block,
                ZERO=_ZERO[fmt.code], HAS_MIN=_HAS_MIN[fmt.code])


def gemm_subs(fmt, weights: int) -> int:
    """Sub-blocks of ``fmt`` a GEMM's K step decodes to take ``weights`` weights of K
    (a power of two, at least one sub-block; :func:`gemm_dot_range`'s ``SUBS``); for
    formats of 32-weight blocks at most 128 weights, four blocks' scales (eight spilled
    registers for Q5_0 on sm_90)."""
    if fmt.block_elements == 32:
        weights = min(weights, 128)
    return max(1, weights // fmt.sub_elements)


class GemvTiling(TypedDict, total=False):
    """A forced tiling of the block GEMVs (tests, sweeps), given as keyword arguments:
    ``block_n`` weight rows per program (default 4), ``split_k`` K ranges (default:
    :func:`split_k_ranges`), ``blocks_per_step`` blocks of K per step (default 2, or 16 of
    32 weights), ``num_warps`` (default 4). None is the default; with none of the first
    three given, the rows on CUDA filling the SMs twice over, the kernel is autotuned
    instead (:func:`gemv_tiling`)."""

    block_n: int | None
    split_k: int | None
    blocks_per_step: int | None
    num_warps: int


def gemv_tiling(tiling: GemvTiling, device: torch.device, rows: int,
                block_elements: int = 256) -> tuple[int, int, int | None, int] | None:
    """``(block_n, blocks_per_step, split_k, num_warps)`` of a GEMV over ``rows`` weight
    rows of blocks of ``block_elements`` weights, ``tiling``'s with the defaults filled
    in; None where the autotuned kernel runs instead.

    Raises:
        TypeError: a key that is not :class:`GemvTiling`'s.
    """
    if unknown := set(tiling) - set(GemvTiling.__annotations__):
        raise TypeError(f"unexpected GEMV tiling arguments: {', '.join(sorted(unknown))}")
    block_n, split_k, kb = tiling.get("block_n"), tiling.get("split_k"), tiling.get("blocks_per_step")
    if (device.type == "cuda" and not INTERPRETING and block_n is None and split_k is None and kb is None
            and rows >= 2 * sm_count(device.index or 0)):
        return None
    return block_n or 4, kb or (2 if block_elements > 32 else 16), split_k, tiling.get("num_warps") or 4


def output_for(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{x.shape[0]}, {n}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} stride {out.stride()}")
    return out
