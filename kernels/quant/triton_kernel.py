"""Triton kernels over GGUF blocks: dequantize inside the matmul, never to memory.

Two kernels share one block decoder (:mod:`kernels.quant.triton_decode`):

- :func:`quant_gemv`, for decode rows (``M <= gemv_max_rows()``): one program per
  (activation row, ``BLOCK_N`` weight rows, range of K); it walks its range ``KB``
  blocks at a time in a ``[KB, NSUB, BLOCK_N, L]`` tile whose rows stay in each
  thread's registers, so the activations are loaded and converted once for them. Each
  sub-block's codes times the activations are summed in registers and scaled once,
  ``y += scale * sum(q * x) + offset * sum(x)``. Tiling autotuned per (N, K, type);
  split-K (float32 partial sums, added in a fixed order) only when N is small.
- :func:`quant_gemm`, for batched decode and short prefills: each program owns a
  ``BLOCK_M x BLOCK_N`` output tile and walks its range of K's sub-blocks in one runtime
  loop (bounded registers), decoding each into weights in registers and multiplying
  them with the activations on tensor cores (``tl.dot``), so the weights are read once
  for the tile's rows; K split where the tiles do not fill the SMs. Bfloat16 rows of
  Q4_0, Q8_0, Q4_K, Q5_K and Q6_K (repacked: Q6_K_P) blocks take the packed GEMM instead (:mod:`kernels.quant.triton_packed_gemm`:
  four codes a register decoded to bfloat16 pairs in PTX, 2-3.5x faster on an H200).

Long prefill chunks (from the ``quant_dequant_rows`` switch's rows) dequantize the
weight whole into the activations' dtype and multiply with cuBLAS
(:mod:`kernels.quant.triton_dequant`).

Q4_K and Q6_K decode rows go to the int8-activation GEMV of
:mod:`kernels.quant.triton_int8` instead (integer dot products on activations rounded
to int8 per 32 values, as llama.cpp's CUDA kernels do; with Q6_K repacked into aligned
planes it decoded the 8B shape at batch 1 in 3.68 ms a step against the float GEMV's
4.47 on the H200). Which GEMV runs and where its activations are quantized are the
``quant_int8*`` switches (:mod:`kernels.quant.int8_choice`, :mod:`kernels.switches`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.quant.gemm_tuning import IEEE_TILING, GemmTiling, tuned
from kernels.quant.int8_choice import int8_quantize_apart, uses_int8_dot
from kernels.quant.split_k import partials_at, split_k_ranges, split_output, sum_partials
from kernels.quant.triton_decode import (
    INTERPRETING,
    GemvTiling,
    check_blocks,
    gemm_dot_range,
    gemm_subs,
    gemm_tile,
    gemv_dot,
    gemv_tiling,
    layout_constexprs,
    output_for,
    ptx_enabled,
    store_tile,
)
from kernels.quant.triton_int8_gemm import INT8_GEMM_TYPES, int8_gemm
from kernels.quant.triton_packed_gemm import PACKED_TYPES, packed_gemm
from kernels.switches import current

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, blocks_per_split, stride_xm, stride_om,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr, KB: tl.constexpr, PARTIALS: tl.constexpr, ASM: tl.constexpr,
):
    # One activation row per program, the rows of one weight tile launched one after
    # another (so the rows after the first read the tile from L2); axis 0 for the
    # rows x tiles (an LM head's tiles outnumber axis 1's 65535).
    pid_m = tl.program_id(0) % M
    pid_n = tl.program_id(0) // M
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :]
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes  # [1, 1, BLOCK_N]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, K // QK)
    total = gemv_dot(x_row, row_ptr, kb_begin, kb_end, K // QK, QT, QK, BB, L, NSUB, ZERO, HAS_MIN, BLOCK_N, KB, ASM)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = partials_at(out_ptr, pid_k, M, stride_om, PARTIALS) + pid_m * stride_om + cols
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, blocks_per_split, stride_xm, stride_om,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    PARTIALS: tl.constexpr, SUBS: tl.constexpr,
):
    rows, row_ptr, ms, m_mask, pid_k = gemm_tile(w_ptr, M, N, row_bytes, BLOCK_M, BLOCK_N)
    x_row = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, K // QK)
    acc = gemm_dot_range(x_row, m_mask, row_ptr, kb_begin, kb_end, K // QK, QT, QK, BB, L, NSUB, ZERO, HAS_MIN,
                         BLOCK_M, BLOCK_N, IEEE, SUBS)
    store_tile(partials_at(out_ptr, pid_k, M, stride_om, PARTIALS), acc, rows, ms, m_mask, N, stride_om)


def _gemv_configs() -> list[triton.Config]:
    """Tilings the tuned GEMV picks from per (N, K, type): rows per program (held in each
    thread's registers), blocks of K per step (spread over the threads), warps."""
    return [triton.Config({"BLOCK_N": block_n, "KB": kb}, num_warps=warps)
            for block_n, kb, warps in ((2, 4, 2), (4, 2, 2), (4, 4, 2), (8, 2, 2), (8, 4, 2), (4, 8, 4), (8, 4, 4),
                                       (16, 2, 2))]


def _prune(configs, named_args, **kwargs):
    """32-weight blocks: 8 times the blocks per step (the tile's size in weights as for
    K-quants' 256)."""
    if named_args.get("QK", kwargs.get("QK")) == 256:
        return configs
    return [triton.Config({**c.kwargs, "KB": c.kwargs["KB"] * 8}, num_warps=c.num_warps) for c in configs]


_gemv_tuned = triton.autotune(
    configs=_gemv_configs(), key=["N", "K", "QT"], prune_configs_by={"early_config_prune": _prune},
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
)(_gemv_kernel)


def quant_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_name: str,
    *,
    out: torch.Tensor | None = None,
    int8_dot: bool | None = None,
    q8=None,
    **tiling: Unpack[GemvTiling],
) -> torch.Tensor:
    """``x @ W.T`` for few rows of ``x``, ``W`` dequantized on the fly from ``blocks``.

    One program per (activation row, ``block_n`` weight rows, K range); a program walks
    its range ``blocks_per_step`` blocks at a time, sums each sub-block's codes times the
    activations in registers and scales the sum once (the min's share as ``min * sum(x)``).
    On CUDA with no tiling given, the tiling is autotuned per (N, K, type) when the
    weight rows fill the SMs (:func:`_gemv_configs`); for fewer rows K is split so the
    grid holds four programs per SM, float32 partial sums added in a fixed order.

    Args:
        x: ``[M, K]`` float32/bfloat16/float16; each row is one program column, so the
            weights are read from HBM once and from L2 ``M - 1`` more times.
        blocks: ``[N, K / block_elements * block_bytes]`` uint8, GGUF blocks row by row.
        type_name: the GGML type (``"Q4_K"`` ...).
        out: where to write ``[M, N]`` (``x.dtype``, unit column stride; may be a column
            slice of a wider tensor), else a new tensor.
        int8_dot: Q4_K/Q6_K through the int8-activation GEMV
            (:mod:`kernels.quant.triton_int8`: activations rounded to int8 per 32
            values, integer dot products); default: the ``quant_int8`` switch
            (:mod:`kernels.switches`). Other types ignore it.
        q8: ``x`` already quantized (:func:`kernels.quant.triton_activations.quantize_activations`),
            shared by the parts of a fused projection; else the int8 GEMV quantizes
            ``x`` itself (:func:`int8_quantize_apart` false: one launch) or after a
            quantizing launch.
        tiling: ``block_n``, ``split_k``, ``blocks_per_step``, ``num_warps``, a forced
            tiling (:class:`~kernels.quant.triton_decode.GemvTiling`).

    Returns:
        ``[M, N]`` in ``x.dtype`` (float32 accumulation): ``out`` when given.

    Raises:
        ValueError: shapes or dtypes that do not match the format.
    """
    fmt, k = check_blocks(x, blocks, type_name)
    m, n = x.shape[0], blocks.shape[0]
    nblocks = k // fmt.block_elements
    if uses_int8_dot(type_name, int8_dot):
        from kernels.quant.triton_activations import quantize_activations
        from kernels.quant.triton_int8 import int8_gemv

        if q8 is None:
            q8 = quantize_activations(x) if int8_quantize_apart() else x
        return int8_gemv(q8, blocks, type_name, out=out, **tiling)
    result = output_for(x, n, out)
    forced = gemv_tiling(tiling, x.device, n, fmt.block_elements)
    if forced is None:
        _gemv_tuned[lambda meta: (m * triton.cdiv(n, meta["BLOCK_N"]), 1)](
            x, blocks, result, m, n, k, blocks.stride(0), nblocks, x.stride(0), result.stride(0),
            **layout_constexprs(fmt), PARTIALS=False, ASM=ptx_enabled(x.device),
        )
        return result
    block_n, kb, split_k, num_warps = forced
    per_split, split = split_k_ranges(nblocks, kb, m * triton.cdiv(n, block_n), x.device, split_k)
    dest = split_output(result, split)
    _gemv_kernel[(m * triton.cdiv(n, block_n), split)](
        x, blocks, dest, m, n, k, blocks.stride(0), per_split, x.stride(0), dest.stride(-2),
        **layout_constexprs(fmt), BLOCK_N=block_n, KB=kb, PARTIALS=split > 1, ASM=ptx_enabled(x.device),
        num_warps=num_warps,
    )
    return sum_partials(result, dest)


def quant_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_name: str,
    *,
    block_m: int | None = None,
    tiling: GemmTiling | None = None,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for more rows of ``x`` than the GEMV takes (batched decode, prefill):
    each program decodes a ``tiling.block_n``-row tile of ``W``, ``tiling.k_step``
    weights of K at a time, into registers and multiplies it with ``block_m`` rows of
    ``x`` on tensor cores (:func:`kernels.quant.triton_decode.gemm_dot_range`), so the
    weights are read and decoded once per ``block_m`` rows. Where the tiles do not fill
    the SMs (few rows, few columns), K is split so the grid holds four programs per SM,
    float32 partial sums added in a fixed order (as :func:`quant_gemv`).

    Args:
        x, blocks, type_name, out: as :func:`quant_gemv`.
        block_m: rows per tile (default: the rows rounded up to 16, 32 or 64).
        tiling: a forced tiling (tests, sweeps); default: float32 rows
            :data:`~kernels.quant.gemm_tuning.IEEE_TILING`, 16-bit ones on CUDA the
            fastest of :data:`~kernels.quant.gemm_tuning.GEMM_TILINGS` (with the
            ``quant_gemm_int8`` switch on, of the int8 GEMM's
            :data:`~kernels.quant.gemm_tuning.INT8_TILINGS`; bfloat16 rows of the packed
            GEMM's types with PTX and the ``quant_gemm_packed`` switch on, of the packed
            GEMM's :data:`~kernels.quant.gemm_tuning.PACKED_TILINGS`) for this
            (``block_m``, N, K, type), timed at its first call outside a CUDA graph
            capture (:func:`~kernels.quant.gemm_tuning.tuned`). A tiling with ``int8``
            runs :func:`kernels.quant.triton_int8_gemm.int8_gemm`, one with ``packed``
            :func:`kernels.quant.triton_packed_gemm.packed_gemm`.
        split_k: K ranges (default: fill the SMs).

    Returns:
        ``[M, N]`` in ``x.dtype``; float32 inputs multiply in IEEE float32 (no TF32),
        16-bit ones with the decoded weight tile rounded to their dtype.

    Raises:
        ValueError: shapes or dtypes that do not match the format.
    """
    fmt, k = check_blocks(x, blocks, type_name)
    m, n = x.shape[0], blocks.shape[0]
    block_m = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    ieee = x.dtype == torch.float32 or INTERPRETING
    if tiling is None and x.dtype == torch.float32:
        tiling = IEEE_TILING
    elif tiling is None:
        tiling = tuned(block_m, n, k, type_name, x.device,
                       lambda t: quant_gemm(x, blocks, type_name, block_m=block_m, tiling=t, split_k=split_k),
                       _family(x, blocks, type_name))
    if tiling.packed:
        return packed_gemm(x, blocks, type_name, block_m=block_m, block_n=tiling.block_n, num_warps=tiling.num_warps,
                           num_stages=tiling.num_stages, split_k=split_k, out=out)
    if tiling.int8:
        return int8_gemm(x, blocks, type_name, block_m=block_m, block_n=tiling.block_n, groups=tiling.k_step // 32,
                         num_warps=tiling.num_warps, num_stages=tiling.num_stages, split_k=split_k, out=out)
    nblocks = k // fmt.block_elements
    result = output_for(x, n, out)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, tiling.block_n)
    per_split, split = split_k_ranges(nblocks, 1, tiles, x.device, split_k)
    dest = split_output(result, split)
    _gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, tiling.block_n), split)](
        x, blocks, dest, m, n, k, blocks.stride(0), per_split, x.stride(0), dest.stride(-2),
        **layout_constexprs(fmt), BLOCK_M=block_m, BLOCK_N=tiling.block_n,
        IEEE=ieee, PARTIALS=split > 1, SUBS=gemm_subs(fmt, tiling.k_step),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return sum_partials(result, dest)


def _family(x: torch.Tensor, blocks: torch.Tensor, type_name: str) -> str:
    """Which GEMM family 16-bit rows of ``x`` take over ``type_name`` ``blocks``: the
    packed GEMM (bfloat16 rows, its types, PTX on, the ``quant_gemm_packed`` switch on,
    and for the K-quants rows the 32-bit reads of their scales can take: a fused
    projection's part after a part of 32-weight blocks may start 2 bytes off), the int8
    GEMM (the ``quant_gemm_int8`` switch on), else the float tile GEMM."""
    switches = current()
    if (switches.quant_gemm_packed and type_name in PACKED_TYPES and x.dtype == torch.bfloat16
            and ptx_enabled(x.device) and (type_name in ("Q4_0", "Q8_0")
                                           or (blocks.data_ptr() % 4 == 0 and blocks.stride(0) % 4 == 0))):
        return "packed"
    if switches.quant_gemm_int8 and type_name in INT8_GEMM_TYPES:
        return "int8"
    return "float"


def gemv_max_rows() -> int:
    """Rows of activations up to which a projection runs the GEMV (decode batches); the
    GEMM above: the ``quant_gemv_rows`` switch (:mod:`kernels.switches`), read at each call."""
    return current().quant_gemv_rows


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, type_name: str, out: torch.Tensor | None = None,
                 q8=None) -> torch.Tensor:
    """``x @ W.T``: the GEMV for up to :func:`gemv_max_rows` rows, from
    :func:`kernels.quant.triton_dequant.dequantize_rows` rows ``W`` dequantized whole and
    multiplied by cuBLAS, the GEMM between (``out`` and ``q8`` as in :func:`quant_gemv`)."""
    from kernels.quant.triton_dequant import dequant_matmul, dequantize_rows

    m = x.shape[0]
    if m <= gemv_max_rows():
        return quant_gemv(x, blocks, type_name, out=out, q8=q8)
    if 0 < dequantize_rows() <= m:
        return dequant_matmul(x, blocks, type_name, out=out)
    return quant_gemm(x, blocks, type_name, out=out)
