"""Triton fused mixture-of-experts; reference in :mod:`kernels.moe.reference`.

The routed rows (token ``t``'s ``k``-th choice is row ``t * K + k``) are sorted by
expert and padded to whole blocks (:func:`kernels.moe.reference.align_to_blocks`); then two
grouped GEMMs run over them, each program one block of ``BLOCK_M`` rows of one expert
times one tile of ``BLOCK_N`` output columns:

1. gate/up: ``[R, H] x [E, 2I, H] -> [R, I]``; the gate and up tiles of the same
   columns are accumulated side by side and SiLU-and-mul is applied as they are
   written, so the ``[R, 2I]`` product never exists;
2. down: ``[R, I] x [E, H, I] -> [R, H]``, each row scaled by its router weight.

gpt-oss's experts add a bias to each projection and replace SiLU-and-mul by a clamped
SwiGLU; both happen in the same epilogues (:func:`biased_epilogue`).

The ``K`` rows of a token are then summed in torch. Nothing is read back to the host
(the used length of the sort is read by the kernels), so a decode step with it can be
captured in a CUDA graph. Rounding follows the reference's eager ops (each product and
the SiLU rounded to the activation dtype, :mod:`kernels.triton_round`), the sum over
the ``K`` choices excepted: the reference adds experts in expert order, here the
choices of a token add in rank order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.activation.reference import ClampedSwiGLU
from kernels.moe.reference import ExpertBiases, align_to_blocks
from kernels.triton_round import round_to

# Triton's interpreter multiplies bfloat16 tiles wrongly in ``tl.dot``; there the tiles
# are widened to float32 first (exact: a product of two bfloat16 values fits float32).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_tiles(A, W, a_rows, row_mask, w_cols, col_mask, kk, kmask, stride_am, stride_wn, F32_DOT: tl.constexpr):
    a = tl.load(A + a_rows[:, None] * stride_am + kk[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0)
    w = tl.load(W + w_cols[None, :] * stride_wn + kk[:, None], mask=col_mask[None, :] & kmask[:, None], other=0.0)
    if F32_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return a, w


@triton.jit
def sorted_block(SortedRows, BlockExperts, pid_m, num_rows, top_k, GATED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block ``pid_m`` of the rows sorted by expert (:func:`kernels.moe.reference.align_to_blocks`):
    ``(expert, rows, live, x_rows)``, its expert, its ``BLOCK_M`` routed rows ``r`` (int64;
    padding ``>= num_rows``), which are real, and the hidden state each reads (``r //
    top_k`` with ``GATED``, the first projection's input; else ``r``)."""
    expert = tl.load(BlockExperts + pid_m).to(tl.int64)
    rows = tl.load(SortedRows + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, rows, rows < num_rows, rows // top_k if GATED else rows


@triton.jit
def moe_epilogue(acc, acc_up, dt: tl.constexpr, GATED: tl.constexpr):
    """The float32 sums rounded to ``dt`` as the reference's eager ops round them: the
    product alone, or with ``GATED`` ``silu(gate) * up`` (``acc`` the gate's sums,
    ``acc_up`` the up's), each op rounded."""
    res = round_to(acc, dt)
    if GATED:
        act = round_to(res / (1.0 + tl.exp(-res)), dt)
        res = round_to(act * round_to(acc_up, dt), dt)
    return res


@triton.jit
def biased_epilogue(acc, acc_up, Bias, bias_up, cols, n, alpha, limit, dt: tl.constexpr, GATED: tl.constexpr,
                    BIASED: tl.constexpr, CLAMPED: tl.constexpr):
    """:func:`moe_epilogue` with gpt-oss's experts' parts:
    with BIASED, ``Bias[cols]`` added to the sums (and ``Bias[bias_up + cols]`` to the
    up's; ``Bias`` the expert's row, columns from ``n`` on masked), each rounded to ``dt``
    as the reference's biased product; with CLAMPED, ``(clamp(up, ±limit) + 1) *
    g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, each op rounded as the
    reference's eager ops (:class:`~kernels.activation.reference.ClampedSwiGLU`)."""
    if not BIASED and not CLAMPED:
        return moe_epilogue(acc, acc_up, dt, GATED)
    if BIASED:
        acc += tl.load(Bias + cols, mask=cols < n, other=0.0).to(tl.float32)
    res = round_to(acc, dt)
    if GATED:
        if BIASED:
            acc_up += tl.load(Bias + bias_up + cols, mask=cols < n, other=0.0).to(tl.float32)
        up = round_to(acc_up, dt)
        if CLAMPED:
            gate = tl.minimum(res, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            glu = round_to(gate * round_to(tl.sigmoid(round_to(gate * alpha, dt)), dt), dt)
            res = round_to(round_to(up + 1.0, dt) * glu, dt)
        else:
            res = round_to(round_to(res / (1.0 + tl.exp(-res)), dt) * up, dt)
    return res


@triton.jit
def _grouped_gemm_kernel(
    A, W, Out, RouteWeights, SortedRows, BlockExperts, NumPadded, Bias, bias_stride, bias_up, alpha, limit,
    num_rows, top_k, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, BIASED: tl.constexpr, CLAMPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, F32_DOT: tl.constexpr,
):
    """GATED: A is ``[T, K]`` hidden states, read at row ``r // top_k``, W ``[E, 2N, K]``;
    out ``[R, N]`` = silu(gate) * up. Else A is ``[R, K]`` read at row ``r``, W
    ``[E, N, K]``; out ``[R, N]``, times ``RouteWeights[r]`` when WEIGHTED. BIASED and
    CLAMPED: gpt-oss's parts (:func:`biased_epilogue`; ``Bias`` ``[E, bias_stride]``)."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert, rows, row_mask, a_rows = sorted_block(SortedRows, BlockExperts, pid_m, num_rows, top_k, GATED, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    Wexp = W + expert * stride_we
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.cdiv(K, BLOCK_K)):
        kk = i * BLOCK_K + rk
        kmask = kk < K
        a, w = _load_tiles(A, Wexp, a_rows, row_mask, cols, col_mask, kk, kmask, stride_am, stride_wn, F32_DOT)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            # The up row of output column j is row N + j of the stacked weight.
            _, wu = _load_tiles(A, Wexp, a_rows, row_mask, cols + N, col_mask, kk, kmask, stride_am, stride_wn,
                                F32_DOT)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    dt = Out.dtype.element_ty
    res = biased_epilogue(acc, acc_up, Bias + expert * bias_stride, bias_up, cols, N, alpha, limit, dt, GATED,
                          BIASED, CLAMPED)
    if WEIGHTED:
        rw = tl.load(RouteWeights + rows, mask=row_mask, other=0.0).to(tl.float32)
        res = round_to(res * rw[:, None], dt)
    tl.store(Out + rows[:, None] * stride_om + cols[None, :], res.to(dt), mask=row_mask[:, None] & col_mask[None, :])


def _block_m(rows: int) -> int:
    # Decode routes a few rows per expert: small blocks waste less padding.
    return 16 if rows <= 64 else 64


def _launch(a, w, out, route_weights, sorted_rows, block_experts, num_padded, *, top_k, n, gated, block_m,
            bias=None, activation=None):
    """One grouped GEMM (:func:`_grouped_gemm_kernel`); ``bias`` ``[E, n]`` (gated:
    ``[E, 2n]``, the up's half second) added to the sums, ``activation`` the clamped
    SwiGLU of a gated pass."""
    k = w.shape[-1]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    fp32 = a.dtype == torch.float32
    grid = (sorted_rows.numel() // block_m, triton.cdiv(n, block_n))
    weighted = route_weights is not None
    _grouped_gemm_kernel[grid](
        a, w, out, route_weights if weighted else out, sorted_rows, block_experts, num_padded,
        out if bias is None else bias, 0 if bias is None else bias.shape[1], n,
        0.0 if activation is None else activation.alpha, 0.0 if activation is None else activation.limit,
        out.shape[0], top_k, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATED=gated, WEIGHTED=weighted, BIASED=bias is not None, CLAMPED=activation is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if fp32 else "tf32", F32_DOT=_INTERPRETED,
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    biases: ExpertBiases | None = None,
    activation: ClampedSwiGLU | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.moe.reference.fused_moe` (``block_m`` forces the rows per
    block, for tests; default 16 for up to 64 routed rows, else 64). gpt-oss's expert
    ``biases`` and clamped SwiGLU ``activation`` are added in the GEMMs' epilogues
    (:func:`biased_epilogue`).

    Transient memory: the sort (``4 * (C + C / block_m)`` bytes, ``C`` =
    :func:`kernels.moe.reference.padded_capacity`), the activations ``[R, I]`` and the weighted
    down products ``[R, H]``, ``R = T * K``, in ``x``'s dtype.
    """
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    rows = tokens * top_k
    inter = w_down.shape[-1]
    if rows == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    bm = block_m or _block_m(rows)
    sorted_rows, block_experts, num_padded = align_to_blocks(topk_ids, w_gate_up.shape[0], bm)
    act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    _launch(x, w_gate_up, act, None, sorted_rows, block_experts, num_padded,
            top_k=top_k, n=inter, gated=True, block_m=bm,
            bias=None if biases is None else biases.gate_up.contiguous(), activation=activation)
    down = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _launch(act, w_down, down, weights, sorted_rows, block_experts, num_padded,
            top_k=top_k, n=hidden, gated=False, block_m=bm,
            bias=None if biases is None else biases.down.contiguous())
    return down.view(tokens, top_k, hidden).sum(dim=1)
