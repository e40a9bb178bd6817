"""The block GEMM on int8 tensor cores, as llama.cpp's MMQ multiplies: the activations
rounded to int8 per 32 values once (:func:`kernels.quant.triton_activations.quantize_activations`),
each weight sub-block's codes taken as int8 as they are stored (``code - zero``, no
float decode), their product an int32 ``tl.dot`` of depth 32, and the scales applied to
that sum: for sub-block ``j`` of a weight row and activation group ``g``,

    sum_k w_k x_k = d_x[g] * (scale_j * sum_k q_k c_k + offset_j * sum_k c_k)

with ``w = scale * q + offset`` (:mod:`kernels.quant.triton_decode`) and ``x ~= d_x * c``.
Formats of 16-weight sub-blocks (Q4_0 ... Q5_1's nibble halves, Q6_K) take two
depth-32 products a group, each over one sub-block's half (the other half's codes
zeroed), and the codes' sums per 16 for their offsets. Compared with the float tile GEMM
(:func:`kernels.quant.triton_kernel.quant_gemm`) it rounds the activations to 8 bits
(as the int8 GEMV does) and keeps the weights exact; its reference is the product of
the dequantized weights with the dequantized int8 activations (float64).

One program per (``BLOCK_M`` rows, ``BLOCK_N`` weight rows, K range); ``GROUPS``
activation groups a loop step. It is one of the block GEMM's tilings
(:class:`kernels.quant.gemm_tuning.GemmTiling` with ``int8``), timed against the float
ones per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant.split_k import partials_at, split_k_ranges, split_output, sum_partials
from kernels.quant.triton_activations import Q8Activations, quantize_activations
from kernels.quant.triton_decode import (
    _codes,
    _q6p_codes,
    _q6p_fields,
    _q6p_scale,
    _scales,
    check_blocks,
    gemm_tile,
    layout_constexprs,
    output_for,
    store_tile,
)


@triton.jit
def _sub_scales(row_ptr, kb, NB, QT: tl.constexpr, BB: tl.constexpr, S):
    """``(scale, offset)`` ``[BLOCK_N]`` of sub-block ``S`` of block ``kb`` of the rows at
    ``row_ptr`` (``NB`` blocks a row), GGUF blocks or Q6_K's planes alike."""
    if QT == 8:
        _, _, sc, dp = _q6p_fields(row_ptr, kb, NB)
        scale = _q6p_scale(sc, dp, S)
        return scale, scale * 0.0
    return _scales(row_ptr + kb * BB, QT, S)


@triton.jit
def _group_dot(xq, row_ptr, kb, NB, t, QT: tl.constexpr, BB: tl.constexpr, S, ZERO: tl.constexpr,
               HALF: tl.constexpr):
    """int32 ``[BLOCK_M, BLOCK_N]``: activation codes ``xq`` ``[BLOCK_M, 32]`` times the
    int8 codes (``code - ZERO``) of sub-block ``S`` of block ``kb`` of the rows at
    ``row_ptr`` (``[BLOCK_N]`` pointers; ``t`` the ``[1, 32]`` element range); ``HALF``
    0/1 for the first or second 16 of a group when a sub-block holds 16 weights (the
    rest zeroed), -1 for 32."""
    tt = t if HALF < 0 else t - 16 * HALF
    live = (tt >= 0) & (tt < 32 if HALF < 0 else tt < 16)
    tt = tl.where(live, tt, 0)
    if QT == 8:
        ql, qh, _, _ = _q6p_fields(row_ptr, kb, NB)
        q = _q6p_codes(ql[:, None], qh[:, None], tt, S) - ZERO
    else:
        q = _codes((row_ptr + kb * BB)[:, None], tt, QT, S) - ZERO
    q = tl.where(live, q, 0)
    return tl.dot(xq, tl.trans(q.to(tl.int8)), out_dtype=tl.int32)


@triton.jit
def _int8_gemm_kernel(
    xq_ptr, xd_ptr, xs_ptr, w_ptr, out_ptr, M, N, K, row_bytes, blocks_per_split,
    stride_xq, stride_xd, stride_xs, stride_om,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    rows, row_ptr, ms, m_mask, pid_k = gemm_tile(w_ptr, M, N, row_bytes, BLOCK_M, BLOCK_N)
    ms64 = tl.minimum(ms, M - 1).to(tl.int64)
    t = tl.arange(0, 32)[None, :]
    # K in activation groups of 32; a block holds QK // 32 of them (or one block is one).
    groups_per_block: tl.constexpr = QK // 32
    g_begin = pid_k * blocks_per_split * groups_per_block
    nblocks = K // QK
    g_end = tl.minimum(pid_k * blocks_per_split + blocks_per_split, nblocks) * groups_per_block
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(g_begin, g_end, GROUPS):
        for i in tl.static_range(GROUPS):
            g = tl.minimum(g0 + i, g_end - 1)
            live = m_mask & (g0 + i + 0 * ms < g_end)
            xq = tl.load(xq_ptr + ms64[:, None] * stride_xq + g * 32 + t, mask=live[:, None], other=0)
            dx = tl.load(xd_ptr + ms64 * stride_xd + g, mask=live, other=0.0)
            kb = g // groups_per_block
            if L == 32:
                s = g % groups_per_block
                scale, offset = _sub_scales(row_ptr, kb, nblocks, QT, BB, s)
                part = _group_dot(xq, row_ptr, kb, nblocks, t, QT, BB, s, ZERO, -1).to(tl.float32) * scale[None, :]
                if HAS_MIN:
                    sx = (tl.load(xs_ptr + ms64 * stride_xs + 2 * g, mask=live, other=0)
                          + tl.load(xs_ptr + ms64 * stride_xs + 2 * g + 1, mask=live, other=0)).to(tl.float32)
                    part += sx[:, None] * offset[None, :]
            else:  # two 16-weight sub-blocks a group (Q4_0 ... Q5_1's nibble halves, Q6_K)
                s0 = 2 * (g % groups_per_block)
                scale0, offset0 = _sub_scales(row_ptr, kb, nblocks, QT, BB, s0)
                scale1, offset1 = _sub_scales(row_ptr, kb, nblocks, QT, BB, s0 + 1)
                part = (_group_dot(xq, row_ptr, kb, nblocks, t, QT, BB, s0, ZERO, 0).to(tl.float32) * scale0[None, :]
                        + _group_dot(xq, row_ptr, kb, nblocks, t, QT, BB, s0 + 1, ZERO, 1).to(tl.float32)
                        * scale1[None, :])
                if HAS_MIN:
                    sx0 = tl.load(xs_ptr + ms64 * stride_xs + 2 * g, mask=live, other=0).to(tl.float32)
                    sx1 = tl.load(xs_ptr + ms64 * stride_xs + 2 * g + 1, mask=live, other=0).to(tl.float32)
                    part += sx0[:, None] * offset0[None, :] + sx1[:, None] * offset1[None, :]
            acc += dx[:, None] * part
    store_tile(partials_at(out_ptr, pid_k, M, stride_om, PARTIALS), acc, rows, ms, m_mask, N, stride_om)


# The block types whose codes the kernel reads: GGUF's, and Q6_K repacked into planes.
INT8_GEMM_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q6_K_P")


def int8_gemm(x: torch.Tensor | Q8Activations, blocks: torch.Tensor, type_name: str, *, block_m: int = 64,
              block_n: int = 64, groups: int = 4, num_warps: int = 4, num_stages: int = 2,
              split_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` on int8 tensor cores: ``x`` ``[M, K]`` (quantized here, one launch) or
    already quantized, ``W`` the ``[N, ...]`` uint8 GGUF blocks of ``type_name`` (one of
    :data:`INT8_GEMM_TYPES`).

    Args:
        block_m, block_n: rows of ``x`` and of ``W`` a program (``block_m`` >= 16).
        groups: activation groups of 32 a loop step (unrolled).
        num_warps, num_stages: Triton's launch options.
        split_k: K ranges (default: four programs per SM), their partial sums added in a
            fixed order (:func:`~kernels.quant.split_k.split_output`).
        out: where to write ``[M, N]`` (``x``'s dtype), else a new tensor.

    Returns:
        ``[M, N]`` in the activations' dtype (float32 accumulation).

    Raises:
        ValueError: a type not in :data:`INT8_GEMM_TYPES`, or shapes that do not match.
    """
    if type_name not in INT8_GEMM_TYPES:
        raise ValueError(f"the int8 block GEMM reads {', '.join(INT8_GEMM_TYPES)}, not {type_name}")
    q8 = x if isinstance(x, Q8Activations) else quantize_activations(x)
    fmt, k = check_blocks(q8.codes, blocks, type_name)
    m, n = q8.codes.shape[0], blocks.shape[0]
    nblocks = k // fmt.block_elements
    result = output_for(q8.codes.new_empty((m, 0), dtype=q8.dtype), n, out)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    per_split, split = split_k_ranges(nblocks, 1, tiles, blocks.device, split_k)
    dest = split_output(result, split)
    _int8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        q8.codes, q8.scales, q8.sums, blocks, dest, m, n, k, blocks.stride(0), per_split,
        q8.codes.stride(0), q8.scales.stride(0), q8.sums.stride(0), dest.stride(-2),
        **layout_constexprs(fmt), BLOCK_M=block_m, BLOCK_N=block_n, GROUPS=groups, PARTIALS=split > 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    return sum_partials(result, dest)
