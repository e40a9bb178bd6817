"""Projections of a decode step of a few tokens, in Triton; references in
:mod:`kernels.gemv.reference`.

At batch 1 a decode step's projections are matrix-vector products: tiny, and bound by
the time a kernel takes to start and stream its weights rather than by arithmetic. One
program here owns ``BLOCK_N`` output columns and streams their weight rows once for
all (at most :data:`MAX_ROWS`) token rows, with the rows padded to one 16-row
``tl.dot`` tile. :func:`gate_up_silu` also applies SiLU-and-mul to the gate and up
columns it computed, so the MLP's activation is no launch of its own and its
``[T, 2 * I]`` intermediate is never written.

Rounding follows the references: each product is accumulated in float32 and rounded
once to the output dtype (as cuBLAS does), the activation then rounds like
:func:`kernels.activation.reference.silu_and_mul`. Steps of more rows, float32 models and
strided inputs take the references (cuBLAS).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.activation.triton_kernel import silu_and_mul
from kernels.gemv import reference as ref
from kernels.switches import current
from kernels.triton_round import round_to

MAX_ROWS = 16
# Triton's interpreter multiplies bfloat16 tiles wrongly in ``tl.dot``; there the tiles
# are widened to float32 first (exact: a product of two bfloat16 values fits float32).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Opt-in (the ``gemv`` switch, kernels.switches; ``--gemv``, ``HEADROOM_GEMV=1``): on an
# H200 these kernels were no faster than cuBLAS at batch 1 (Qwen3-0.6B shape: 555 against
# 553 decode tok/s) and add compile time at start, so the projections stay with cuBLAS
# unless asked. Read at each call, so a test can set it.
def _enabled() -> bool:
    return current().gemv
# The reduction width is a compile-time constant (a model has three: hidden size,
# attention width, MLP width), so the loop over it is fully known to the compiler.
_BLOCK_K = 128


@triton.jit
def _gemv_kernel(X, W, Out, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                 F32_DOT: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    for i in range(tl.cdiv(K, BLOCK_K)):
        kk = i * BLOCK_K + rk
        kmask = kk < K
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0)
        if F32_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
        if GATED:
            # The up row of output column j is row N + j of the fused weight.
            wu = tl.load(w_rows + N * stride_wn + kk[None, :], mask=wmask, other=0.0)
            if F32_DOT:
                wu = wu.to(tl.float32)
            acc_up += tl.dot(x, tl.trans(wu))
    dt = Out.dtype.element_ty
    if GATED:
        gate = round_to(acc, dt)
        act = round_to(gate / (1.0 + tl.exp(-gate)), dt)
        res = round_to(act * round_to(acc_up, dt), dt)
    else:
        res = acc
    tl.store(Out + rm[:, None] * stride_om + rn[None, :], res.to(dt), mask=mmask[:, None] & nmask[None, :])


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_enabled() and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)


def _block_n(n: int) -> int:
    # Small tiles: at batch 1 the launch is latency-bound, so more programs (each
    # streaming fewer weight rows) finish sooner; 16 is tl.dot's least width.
    return 16 if n <= 8192 else 32


def _launch(x: torch.Tensor, weight: torch.Tensor, n: int, gated: bool) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n = _block_n(n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), K=k,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=min(_BLOCK_K, max(16, triton.next_power_of_2(k))), GATED=gated, F32_DOT=_INTERPRETED,
        num_warps=4,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.gemv.reference.linear`."""
    if not _fits(x, weight):
        return ref.linear(x, weight)
    return _launch(x, weight, weight.shape[0], gated=False)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.gemv.reference.gate_up_silu`."""
    if not _fits(x, weight):
        return silu_and_mul(ref.linear(x, weight))
    return _launch(x, weight, weight.shape[0] // 2, gated=True)
