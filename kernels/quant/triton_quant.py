"""Triton kernels over GGUF blocks: dequantize inside the matmul, never to memory.

Two kernels share one sub-block decoder (:func:`_sub_block`):

- :func:`quant_gemv`, for decode rows (``M <= GEMV_MAX_ROWS``): each program owns
  ``BLOCK_N`` weight rows and a range of blocks along K (split-K, partial sums added
  atomically into a float32 output when the range is split), the sub-blocks unrolled.
  The weight bytes are read once per step whatever ``M``.
- :func:`quant_gemm`, for prefill: each program owns a ``BLOCK_M x BLOCK_N`` output
  tile and walks the sub-blocks in one runtime loop (bounded registers).

The GEMV dequantizes each sub-block in registers (``w = scale * q + offset``) and
accumulates ``x * w`` elementwise in a ``[BLOCK_M, BLOCK_N, L]`` float32 tile, summed
over ``L`` once at the end. The GEMM multiplies the activations by the raw integer
codes on tensor cores (``tl.dot``; the codes are exact in bfloat16) and applies each
sub-block's scale and offset to the sums, ``y += scale * (x @ q) + offset * sum(x)``,
so no weight is rounded to 16 bits.

A sub-block is ``L`` consecutive weights of one row that share a scale and an offset
(:mod:`kernels.quant.formats`): the decoder returns the codes ``q [BLOCK_N, L]``, the
scale and the offset ``[BLOCK_N]`` with ``w = scale * q + offset``, read straight from
the block bytes as ggml lays them out (ggml-common.h; decoded as ``gguf.quants``
does). Out-of-range rows are clamped to the last row (their loads stay in bounds, their
stores are masked); blocks past a program's range are loaded from its last block and
multiplied by zeroed activations.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.quant.formats import block_format

# Rows of activations up to which the GEMV runs (decode batches); the GEMM above.
GEMV_MAX_ROWS = 16

# Triton's interpreter mis-converts a float32 tile to bfloat16 before ``tl.dot`` (the
# product comes out as garbage), so there the kernels multiply in float32 whatever the
# activations' dtype.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _f16(ptr):
    """float32 of the little-endian float16 at ``ptr`` (a ``[BLOCK_N]`` pointer)."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(blk, S):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block ``S`` (constexpr or runtime) from
    the 12 packed bytes at ``blk + 4`` (ggml's ``get_scale_min_k4``). Both halves'
    formulas are evaluated (their loads stay inside the block) and one is selected, so a
    runtime ``S`` needs no branch."""
    low = tl.load(blk + 4 + S).to(tl.int32)
    packed = tl.load(blk + 8 + S).to(tl.int32)
    sc = tl.where(S < 4, low & 63, (packed & 15) | ((tl.load(blk + S).to(tl.int32) >> 6) << 4))
    mn = tl.where(S < 4, packed & 63, (packed >> 4) | ((low >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _sub_block(blk, t, QT: tl.constexpr, S):
    """Sub-block ``S`` of the blocks at ``blk`` (``[BLOCK_N]`` uint8 pointers, one per
    row): ``(q [BLOCK_N, L] float32, scale [BLOCK_N], offset [BLOCK_N])``, weights
    ``scale * q + offset``; the codes ``q`` are small integers (exact in bfloat16).
    ``t`` is ``tl.arange(0, L)``; ``QT`` the format's code; ``S`` constexpr (unrolled
    loops) or runtime."""
    b = blk[:, None]
    tt = t[None, :]
    if QT == 0:  # Q4_0: d, 16 bytes of nibbles (low: weights 0-15, high: 16-31)
        d = _f16(blk)
        q = (tl.load(b + 2 + tt).to(tl.int32) >> (4 * S)) & 15
        scale = d
        offset = -8.0 * d
    elif QT == 1:  # Q4_1: d, m, nibbles
        d = _f16(blk)
        q = (tl.load(b + 4 + tt).to(tl.int32) >> (4 * S)) & 15
        scale = d
        offset = _f16(blk + 2)
    elif QT == 2:  # Q5_0: d, 32 high bits, nibbles
        d = _f16(blk)
        hb = (tl.load(b + 2 + 2 * S + tt // 8).to(tl.int32) >> (tt % 8)) & 1
        q = ((tl.load(b + 6 + tt).to(tl.int32) >> (4 * S)) & 15) | (hb << 4)
        scale = d
        offset = -16.0 * d
    elif QT == 3:  # Q5_1: d, m, 32 high bits, nibbles
        d = _f16(blk)
        hb = (tl.load(b + 4 + 2 * S + tt // 8).to(tl.int32) >> (tt % 8)) & 1
        q = ((tl.load(b + 8 + tt).to(tl.int32) >> (4 * S)) & 15) | (hb << 4)
        scale = d
        offset = _f16(blk + 2)
    elif QT == 4:  # Q8_0: d, 32 int8
        scale = _f16(blk)
        q = tl.load(b + 2 + tt).to(tl.int8, bitcast=True).to(tl.int32)
        offset = scale * 0.0
    elif QT == 5:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles in 4 runs of 32
        sc, mn = _k_scale_min(blk, S)
        q = (tl.load(b + 16 + (S // 2) * 32 + tt).to(tl.int32) >> (4 * (S % 2))) & 15
        scale = _f16(blk) * sc
        offset = -_f16(blk + 2) * mn
    elif QT == 6:  # Q5_K: as Q4_K, plus 32 bytes of high bits (bit S of byte t)
        sc, mn = _k_scale_min(blk, S)
        hb = (tl.load(b + 16 + tt).to(tl.int32) >> S) & 1
        q = ((tl.load(b + 48 + (S // 2) * 32 + tt).to(tl.int32) >> (4 * (S % 2))) & 15) | (hb << 4)
        scale = _f16(blk) * sc
        offset = -_f16(blk + 2) * mn
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d
        lo = (tl.load(b + (S // 8) * 64 + 16 * (S % 4) + tt).to(tl.int32) >> (4 * ((S // 4) % 2))) & 15
        hi = (tl.load(b + 128 + (S // 8) * 32 + 16 * (S % 2) + tt).to(tl.int32) >> (2 * ((S // 2) % 4))) & 3
        q = lo | (hi << 4)
        scale = _f16(blk + 208) * tl.load(blk + 192 + S).to(tl.int8, bitcast=True).to(tl.float32)
        offset = -32.0 * scale
    return q.to(tl.float32), scale, offset


@triton.jit
def _codes_dot(xv, q, IEEE: tl.constexpr):
    """``xv [BLOCK_M, L] @ q.T`` -> ``[BLOCK_M, BLOCK_N]`` float32 on tensor cores: the
    integer codes are exact in the activations' 16-bit type (or in float32 with
    ``IEEE``)."""
    if IEEE:
        return tl.dot(xv.to(tl.float32), tl.trans(q), input_precision="ieee")
    return tl.dot(xv, tl.trans(q.to(xv.dtype)))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, blocks_per_split, stride_xm, stride_om,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, KB: tl.constexpr, ATOMIC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    ms = tl.arange(0, BLOCK_M)
    m_mask = ms < M
    t = tl.arange(0, L)
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, K // QK)
    # Products accumulate elementwise and are summed over L once at the end: no
    # cross-thread reduction (shuffles, shared memory, barriers) inside the loop.
    acc = tl.zeros([BLOCK_M, BLOCK_N, L], tl.float32)
    for kb0 in range(kb_begin, kb_end, KB):
        for i in tl.static_range(KB):
            kb = tl.minimum(kb0 + i, kb_end - 1)
            live = (kb0 + i) < kb_end
            blk = row_ptr + kb * BB
            for s in tl.static_range(NSUB):
                q, scale, offset = _sub_block(blk, t, QT, s)
                w = q * scale[:, None] + offset[:, None]  # [BLOCK_N, L]
                k_idx = kb * QK + s * L + t
                xv = tl.load(x_ptr + ms[:, None] * stride_xm + k_idx[None, :], mask=m_mask[:, None] & live, other=0.0)
                acc += xv.to(tl.float32)[:, None, :] * w[None, :, :]
    total = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    out = out_ptr + ms[:, None] * stride_om + rows[None, :]
    mask = m_mask[:, None] & (rows[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out, total, mask=mask)
    else:
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    x_row = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    t = tl.arange(0, L)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # One runtime loop over sub-blocks (not unrolled): one tile's registers live at a time.
    for sb in range(0, (K // QK) * NSUB):
        kb = sb // NSUB
        s = sb % NSUB
        q, scale, offset = _sub_block(row_ptr + kb * BB, t, QT, s)
        xv = tl.load(x_row + (kb * QK + s * L + t)[None, :], mask=m_mask[:, None], other=0.0)
        part = _codes_dot(xv, q, IEEE)
        acc += part * scale[None, :] + tl.sum(xv.to(tl.float32), axis=1)[:, None] * offset[None, :]
    out = out_ptr + ms[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (rows[None, :] < N))


def _check(x: torch.Tensor, blocks: torch.Tensor, type_name: str):
    fmt = block_format(type_name)
    if x.dim() != 2 or blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(f"want x [M, K] and uint8 blocks [N, bytes], got {tuple(x.shape)} and {blocks.dtype} {tuple(blocks.shape)}")
    k = x.shape[1]
    if k % fmt.block_elements or blocks.shape[1] != k // fmt.block_elements * fmt.block_bytes:
        raise ValueError(f"{type_name} blocks {tuple(blocks.shape)} do not hold rows of K={k} weights")
    if x.stride(1) != 1 or blocks.stride(1) != 1:
        raise ValueError("x and blocks need a contiguous last dimension")
    return fmt, k


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split(n_programs: int, nblocks: int, x: torch.Tensor, programs_per_sm: int) -> int:
    """Split K until the grid holds ``programs_per_sm`` programs per SM (a decode GEMV
    of a few thousand rows is otherwise too few programs to keep HBM busy), each range
    at least 4 blocks long."""
    if not x.is_cuda:
        return 1
    want = programs_per_sm * _sm_count(x.device.index or 0)
    return max(1, min(nblocks // 4 or 1, -(-want // n_programs)))


def quant_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_name: str,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    blocks_per_step: int | None = None,
    num_warps: int = 4,
    programs_per_sm: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for few rows of ``x``, ``W`` dequantized on the fly from ``blocks``.

    Args:
        x: ``[M, K]`` float32/bfloat16/float16, ``M <= GEMV_MAX_ROWS`` (any M works; the
            register tile grows with it).
        blocks: ``[N, K / block_elements * block_bytes]`` uint8, GGUF blocks row by row.
        type_name: the GGML type (``"Q4_K"`` ...).
        block_n, split_k, blocks_per_step, num_warps: tiling (defaults: 16 weight rows
            for up to 4 activation rows, else 8; a split that fills the SMs; per step 4
            blocks of 32 weights (2 above 4 rows) or 1 K-quant block).
        programs_per_sm: what the default split aims at.
        out: where to write ``[M, N]`` (``x.dtype``, unit column stride; may be a column
            slice of a wider tensor), else a new tensor.

    Returns:
        ``[M, N]`` in ``x.dtype`` (float32 accumulation): ``out`` when given.

    Raises:
        ValueError: shapes or dtypes that do not match the format.
    """
    fmt, k = _check(x, blocks, type_name)
    m, n = x.shape[0], blocks.shape[0]
    nblocks = k // fmt.block_elements
    # The accumulator holds BLOCK_M x BLOCK_N x L floats: fewer rows and blocks per step
    # for larger M.
    few = m <= 4
    kb = blocks_per_step or (1 if fmt.block_elements > 32 else 4 if few else 2)
    block_n = block_n or (16 if few else 8)
    n_programs = triton.cdiv(n, block_n)
    split = split_k if split_k is not None else _default_split(n_programs, nblocks, x, programs_per_sm)
    per_split = triton.cdiv(nblocks, split)
    split = triton.cdiv(nblocks, per_split)
    atomic = split > 1
    result = _output(x, n, out)
    dest = torch.zeros((m, n), device=x.device, dtype=torch.float32) if atomic else result
    _gemv_kernel[(n_programs, split)](
        x, blocks, dest, m, n, k, blocks.stride(0), per_split, x.stride(0), dest.stride(0),
        QT=fmt.code, QK=fmt.block_elements, BB=fmt.block_bytes, L=fmt.sub_elements, NSUB=fmt.subs_per_block,
        BLOCK_N=block_n, BLOCK_M=triton.next_power_of_2(m), KB=kb, ATOMIC=atomic, num_warps=num_warps,
    )
    if atomic:
        result.copy_(dest)
    return result


def quant_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_name: str,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 8,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for many rows of ``x`` (prefill): ``W`` dequantized tile by tile into
    registers and multiplied with ``tl.dot``.

    Args (``out`` too) and return as :func:`quant_gemv`; float32 inputs multiply in IEEE float32
    (no TF32), 16-bit ones with the weight tile rounded to their dtype.
    """
    fmt, k = _check(x, blocks, type_name)
    m, n = x.shape[0], blocks.shape[0]
    out = _output(x, n, out)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm_kernel[grid](
        x, blocks, out, m, n, k, blocks.stride(0), x.stride(0), out.stride(0),
        QT=fmt.code, QK=fmt.block_elements, BB=fmt.block_bytes, L=fmt.sub_elements, NSUB=fmt.subs_per_block,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32 or _INTERPRETING, num_warps=num_warps,
    )
    return out


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, type_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T``: the GEMV for up to :data:`GEMV_MAX_ROWS` rows, the GEMM above
    (``out`` as in :func:`quant_gemv`)."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return quant_gemv(x, blocks, type_name, out=out)
    return quant_gemm(x, blocks, type_name, out=out)


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{x.shape[0]}, {n}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} stride {out.stride()}")
    return out
