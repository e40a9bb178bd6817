"""GGUF blocks dequantized whole on the GPU, for long prefill chunks: ``W`` decoded into
the activations' dtype (a scratch tensor) and ``x @ W.T`` left to cuBLAS.

Why: at a prefill chunk's hundreds to thousands of rows the product is bound by the
tensor cores, and cuBLAS's bfloat16 GEMM runs them near their peak, which a GEMM that
decodes blocks inside its K loop (:func:`kernels.quant.triton_kernel.quant_gemm`) does
not reach. Decoding costs one read of the blocks and one write and read of the bfloat16
weight: for ``M`` rows that is about ``4 / (2 M)`` bytes per multiply-add, under a tenth
of the GEMM's time from about 256 rows on an H200 (4.8 TB/s against about 600 TFLOP/s of
bfloat16), which is where the ``quant_dequant_rows`` switch starts it by default.

The scratch (``[N, K]`` of the activations' dtype: 235 MiB for a Llama-3-8B's fused
gate/up) comes from the caching allocator and is freed after the product, so the
profile run measures it in the plan's activation peak.

Reference: :func:`kernels.quant.reference.dequantize` (``gguf``'s dequantizers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant.triton_decode import block_sub, check_blocks, layout_constexprs
from kernels.switches import current


@triton.jit
def _dequantize_kernel(
    w_ptr, out_ptr, N, row_bytes, nblocks, stride_on,
    QT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, L: tl.constexpr, NSUB: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (``BLOCK_N`` rows, sub-block of K): its ``[BLOCK_N, L]`` weights."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sb = tl.program_id(1)
    kb = sb // NSUB
    s = sb % NSUB
    t = tl.arange(0, L)
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * row_bytes
    q, scale, offset = block_sub(row_ptr, kb, nblocks, t, QT, BB, s, ZERO)
    w = q * scale[:, None]
    if HAS_MIN:
        w += offset[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_on + (kb * QK + s * L + t)[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None])


def dequantize(blocks: torch.Tensor, type_name: str, in_features: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, block_n: int = 32) -> torch.Tensor:
    """The weight ``[N, in_features]`` of ``blocks`` in ``dtype`` (each weight decoded in
    float32, then rounded once).

    Args:
        blocks: ``[N, in_features / block_elements * block_bytes]`` uint8 on a CUDA
            device (or CPU tensors under Triton's interpreter).
        type_name: the GGML type (or a repacked layout, ``Q6_K_P``).
        in_features: ``K``, whole blocks.
        dtype: float32, bfloat16 or float16.
        out: where to write (``[N, K]`` of ``dtype``, unit column stride: may be a row
            range of a larger weight), else a new tensor.

    Returns:
        ``out`` or a new ``[N, K]`` tensor.

    Raises:
        ValueError: blocks that do not hold rows of ``in_features``, a wrong ``out``.
    """
    probe = torch.empty((0, in_features), device=blocks.device, dtype=dtype)
    fmt, k = check_blocks(probe, blocks, type_name)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty((n, k), device=blocks.device, dtype=dtype)
    elif out.shape != (n, k) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{n}, {k}] {dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} stride {out.stride()}")
    nblocks = k // fmt.block_elements
    if n:
        _dequantize_kernel[(triton.cdiv(n, block_n), nblocks * fmt.subs_per_block)](
            blocks, out, n, blocks.stride(0), nblocks, out.stride(0), **layout_constexprs(fmt), BLOCK_N=block_n,
        )
    return out


def dequantize_rows() -> int:
    """Rows from which :func:`kernels.quant.triton_kernel.quant_matmul` takes
    :func:`dequant_matmul` (0: never): the ``quant_dequant_rows`` switch, read at each call."""
    return current().quant_dequant_rows


def dequant_matmul(x: torch.Tensor, blocks: torch.Tensor, type_name: str,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` with ``W`` dequantized into ``x.dtype`` first (a transient ``[N, K]``
    scratch), the product by ``torch.matmul`` (cuBLAS on CUDA).

    Args:
        x: ``[M, K]`` float32/bfloat16/float16, unit column stride.
        blocks, type_name: as :func:`dequantize`.
        out: where to write ``[M, N]`` (``x.dtype``, unit column stride; may be a column
            slice of a wider tensor), else a new tensor.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    w = dequantize(blocks, type_name, x.shape[1], x.dtype)
    if out is None:
        return x @ w.T
    if out.shape != (x.shape[0], blocks.shape[0]) or out.dtype != x.dtype:
        raise ValueError(f"out must be [{x.shape[0]}, {blocks.shape[0]}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.is_contiguous():
        return torch.matmul(x, w.T, out=out)
    out.copy_(x @ w.T)
    return out
