"""Triton fused mixture of experts over experts kept in GGUF blocks; reference in
:mod:`kernels.moe.quant_reference`.

A layer's routed experts are three stacked block tensors, one GGML type each (a Q4_K_M
file holds gate and up in Q4_K and down in Q4_K or Q6_K): gate and up ``[E, I, ...]``,
down ``[E, H, ...]`` uint8. As :mod:`kernels.moe.triton_kernel` does for dense experts, two
passes run over the routed rows (token ``t``'s ``k``-th choice is row ``t * K + k``):

1. gate/up: ``silu(x @ gate_e.T) * (x @ up_e.T)`` -> ``[R, I]``; the gate and up sums of
   the same columns are kept side by side, so the ``[R, 2I]`` product never exists;
2. down: ``act @ down_e.T`` -> ``[R, H]``, each row times its router weight;

then the ``K`` rows of a token are summed in torch. gpt-oss's experts add their biases
to each pass's sums and take the clamped SwiGLU in place of ``silu(gate) * up`` in the
same epilogue (:func:`~kernels.moe.triton_kernel.biased_epilogue`), so they need no pass of their own. Blocks are dequantized inside the
K loop by the dense kernels' decoders (:mod:`kernels.quant.triton_decode`), never to
memory. Two shapes of program:

- decode (up to :data:`GEMV_MAX_TOKENS` tokens): a **grouped GEMV**, one program per
  (routed row, ``BLOCK_N`` weight rows), reading its expert from ``topk_ids``
  (:func:`kernels.quant.triton_decode.gemv_dot`): no sort, every weight row an expert's
  routed tokens need read once per row;
- prefill: the routed rows sorted by expert and padded to blocks of ``BLOCK_M``
  (:func:`kernels.moe.reference.align_to_blocks`), one program per (block, ``BLOCK_N`` columns)
  multiplying the activations by the weights decoded into registers on tensor cores
  (:func:`kernels.quant.triton_decode.gemm_dot`; for the packed GEMM's types and bfloat16
  rows its decode, :func:`kernels.quant.triton_packed_gemm.packed_dot`).

Nothing is read back to the host, so a decode step with it can be captured in a CUDA
graph. Rounding follows :mod:`kernels.moe.triton_kernel` (each product and the SiLU rounded to
the activation dtype); the GEMV does not round the weights, the sorted GEMM rounds each
decoded weight to the activations' dtype (the packed decode with its scale and offset
rounded to bfloat16 first), as the reference rounds the dequantized weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation.reference import ClampedSwiGLU
from kernels.moe import quant_reference
from kernels.moe.quant_reference import check_cache, check_expert_blocks
from kernels.moe.reference import ExpertBiases, align_to_blocks
from kernels.moe.triton_kernel import _block_m, biased_epilogue, moe_epilogue, sorted_block
from kernels.quant.formats import block_format
from kernels.quant.triton_decode import (
    INTERPRETING,
    gemm_dot,
    gemm_subs,
    gemv_dot,
    layout_constexprs,
    ptx_enabled,
)
from kernels.quant.triton_packed_gemm import PACKED_TYPES, packed_dot
from kernels.switches import current

# Tokens up to which the grouped GEMV runs (decode batches); the sorted GEMM above.
GEMV_MAX_TOKENS = 16
# ``slot_of``'s code for an expert whose pairs another device computes (the CPU's share
# of a host layer, engine.layers.moe.cpu_share): both kernels skip its work, and the down
# pass writes its rows as zeros.
SKIP_SLOT: tl.constexpr = tl.constexpr(quant_reference.SKIP_SLOT)


@triton.jit
def expert_at(expert, SlotOf, a_cache_delta, b_cache_delta, a_expert_bytes, b_expert_bytes, CACHED: tl.constexpr):
    """Byte offsets of ``expert``'s a and b blocks from ``Wa``/``Wb``: its row of the
    stacks, or with CACHED and a slot in ``SlotOf[expert]`` (not -1) that slot's row of
    the cache's stacks, ``*_cache_delta`` bytes away (one address space: the stacks may
    be pinned host memory, read over the bus, and the cache device memory); and whether
    ``SlotOf[expert]`` is :data:`SKIP_SLOT` (another device computes its pairs)."""
    a_at = expert * a_expert_bytes
    b_at = expert * b_expert_bytes
    skip = expert < 0  # never: the ids are experts
    if CACHED:
        slot = tl.load(SlotOf + expert).to(tl.int64)
        skip = slot == SKIP_SLOT
        a_at = tl.where(slot >= 0, a_cache_delta + slot * a_expert_bytes, a_at)
        b_at = tl.where(slot >= 0, b_cache_delta + slot * b_expert_bytes, b_at)
    return a_at, b_at, skip


@triton.jit
def _moe_gemv_kernel(
    X, Wa, Wb, Out, RouteWeights, TopkIds, SlotOf, a_cache_delta, b_cache_delta, Bias, bias_stride, bias_up,
    alpha, limit, num_rows, top_k, N, K, a_expert_bytes, b_expert_bytes, a_row_bytes, b_row_bytes, stride_xm, stride_om,
    A_QT: tl.constexpr, A_QK: tl.constexpr, A_BB: tl.constexpr, A_L: tl.constexpr, A_NSUB: tl.constexpr,
    A_ZERO: tl.constexpr, A_HAS_MIN: tl.constexpr, A_KB: tl.constexpr, A_SUBS: tl.constexpr,
    B_QT: tl.constexpr, B_QK: tl.constexpr, B_BB: tl.constexpr, B_L: tl.constexpr, B_NSUB: tl.constexpr,
    B_ZERO: tl.constexpr, B_HAS_MIN: tl.constexpr, B_KB: tl.constexpr, B_SUBS: tl.constexpr,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, CACHED: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr, BIASED: tl.constexpr, CLAMPED: tl.constexpr,
):
    """GATED: ``X`` ``[T, K]`` read at row ``r // top_k``, ``Wa`` the gate and ``Wb`` the
    up blocks; out ``[R, N]`` = silu(gate) * up. Else ``X`` ``[R, K]`` read at row ``r``,
    ``Wa`` the down blocks; out ``[R, N]``, times ``RouteWeights[r]`` when WEIGHTED. The
    routed rows of one weight tile run one after another (they share experts' rows in L2).
    CACHED: an expert with a cache slot is read there, one with :data:`SKIP_SLOT` not at
    all (:func:`expert_at`; its weighted rows are zeros). BIASED,
    CLAMPED: gpt-oss's parts (:func:`~kernels.moe.triton_kernel.biased_epilogue`; ``Bias`` ``[E, bias_stride]``)."""
    r = tl.program_id(0) % num_rows
    pid_n = tl.program_id(0) // num_rows
    expert = tl.load(TopkIds + r).to(tl.int64)
    a_at, b_at, skip = expert_at(expert, SlotOf, a_cache_delta, b_cache_delta, a_expert_bytes, b_expert_bytes, CACHED)
    if skip:  # another device's pair: no weight read; the weighted pass's row sums to nothing
        if WEIGHTED:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(Out + r.to(tl.int64) * stride_om + cols, tl.zeros([BLOCK_N], Out.dtype.element_ty), mask=cols < N)
        return
    x_row = X + (r // top_k if GATED else r).to(tl.int64) * stride_xm
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :], N - 1).to(tl.int64)
    acc = gemv_dot(x_row, Wa + a_at + rows * a_row_bytes, 0, K // A_QK, K // A_QK,
                    A_QT, A_QK, A_BB, A_L, A_NSUB, A_ZERO, A_HAS_MIN, BLOCK_N, A_KB, ASM)
    acc_up = acc
    if GATED:
        acc_up = gemv_dot(x_row, Wb + b_at + rows * b_row_bytes, 0, K // B_QK, K // B_QK,
                           B_QT, B_QK, B_BB, B_L, B_NSUB, B_ZERO, B_HAS_MIN, BLOCK_N, B_KB, ASM)
    dt = Out.dtype.element_ty
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    res = biased_epilogue(acc, acc_up, Bias + expert * bias_stride, bias_up, cols, N, alpha, limit, dt, GATED,
                          BIASED, CLAMPED)
    if WEIGHTED:
        res = moe_epilogue(res * tl.load(RouteWeights + r).to(tl.float32), res, dt, False)
    tl.store(Out + r.to(tl.int64) * stride_om + cols, res.to(dt), mask=cols < N)


@triton.jit
def _moe_gemm_kernel(
    X, Wa, Wb, Out, RouteWeights, SortedRows, BlockExperts, NumPadded, SlotOf, a_cache_delta, b_cache_delta,
    Bias, bias_stride, bias_up, alpha, limit,
    num_rows, top_k, N, K, a_expert_bytes, b_expert_bytes, a_row_bytes, b_row_bytes, stride_xm, stride_om,
    A_QT: tl.constexpr, A_QK: tl.constexpr, A_BB: tl.constexpr, A_L: tl.constexpr, A_NSUB: tl.constexpr,
    A_ZERO: tl.constexpr, A_HAS_MIN: tl.constexpr, A_KB: tl.constexpr, A_SUBS: tl.constexpr,
    B_QT: tl.constexpr, B_QK: tl.constexpr, B_BB: tl.constexpr, B_L: tl.constexpr, B_NSUB: tl.constexpr,
    B_ZERO: tl.constexpr, B_HAS_MIN: tl.constexpr, B_KB: tl.constexpr, B_SUBS: tl.constexpr,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, CACHED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, A_PACKED: tl.constexpr, B_PACKED: tl.constexpr, ASM: tl.constexpr,
    BIASED: tl.constexpr, CLAMPED: tl.constexpr,
):
    """As :func:`_moe_gemv_kernel`, one program per block of ``BLOCK_M`` sorted rows of one
    expert (:func:`kernels.moe.reference.align_to_blocks`) and ``BLOCK_N`` columns: each
    weight row is read once per block of rows (from the host over the bus too). A matrix
    whose type the packed GEMM reads (``A_PACKED``, ``B_PACKED``) is decoded by its
    :func:`~kernels.quant.triton_packed_gemm.packed_dot`, the others by :func:`gemm_dot`."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert, routed, live, x_rows = sorted_block(SortedRows, BlockExperts, pid_m, num_rows, top_k, GATED, BLOCK_M)
    a_at, b_at, skip = expert_at(expert, SlotOf, a_cache_delta, b_cache_delta, a_expert_bytes, b_expert_bytes, CACHED)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if skip:  # as the GEMV: another device's rows
        if WEIGHTED:
            tl.store(Out + routed[:, None] * stride_om + cols[None, :], tl.zeros([BLOCK_M, BLOCK_N], Out.dtype.element_ty),
                     mask=live[:, None] & (cols[None, :] < N))
        return
    x_row = X + x_rows[:, None] * stride_xm
    rows = tl.minimum(cols, N - 1).to(tl.int64)
    if A_PACKED:
        acc = packed_dot(x_row, live, (Wa + a_at + rows * a_row_bytes)[:, None], 0, K // A_QK, K // A_QK, A_QT,
                         BLOCK_M, BLOCK_N, ASM)
    else:
        acc = gemm_dot(x_row, live, Wa + a_at + rows * a_row_bytes, K // A_QK,
                       A_QT, A_QK, A_BB, A_L, A_NSUB, A_ZERO, A_HAS_MIN, BLOCK_M, BLOCK_N, IEEE, A_SUBS)
    acc_up = acc
    if GATED:
        if B_PACKED:
            acc_up = packed_dot(x_row, live, (Wb + b_at + rows * b_row_bytes)[:, None], 0, K // B_QK, K // B_QK,
                                B_QT, BLOCK_M, BLOCK_N, ASM)
        else:
            acc_up = gemm_dot(x_row, live, Wb + b_at + rows * b_row_bytes, K // B_QK,
                              B_QT, B_QK, B_BB, B_L, B_NSUB, B_ZERO, B_HAS_MIN, BLOCK_M, BLOCK_N, IEEE, B_SUBS)
    dt = Out.dtype.element_ty
    res = biased_epilogue(acc, acc_up, Bias + expert.to(tl.int64) * bias_stride, bias_up, cols[None, :], N, alpha,
                          limit, dt, GATED, BIASED, CLAMPED)
    if WEIGHTED:
        rw = tl.load(RouteWeights + routed, mask=live, other=0.0).to(tl.float32)
        res = moe_epilogue(res * rw[:, None], res, dt, False)
    tl.store(Out + routed[:, None] * stride_om + cols[None, :], res.to(dt), mask=live[:, None] & (cols[None, :] < N))


# Weights of K the sorted GEMM decodes a step: gate and up live in registers together,
# and at 256 they spilled on sm_90.
MOE_GEMM_K_STEP = 128


def _prefixed(prefix: str, type_name: str) -> dict:
    """The kernels' layout constants of ``type_name`` under ``prefix`` (``A_QT`` ...), with
    its GEMV blocks per step (2 of 256 weights, 16 of 32: 512 weights a step either way)
    and its GEMM sub-blocks per step (:data:`MOE_GEMM_K_STEP` weights)."""
    fmt = block_format(type_name)
    layout = {**layout_constexprs(fmt), "KB": 2 if fmt.block_elements > 32 else 16, "SUBS": gemm_subs(fmt, MOE_GEMM_K_STEP)}
    return {f"{prefix}_{k}": v for k, v in layout.items()}


def _launch(x, wa, wb, out, route_weights, types, *, top_k, gemv, sort, block_n, num_warps, cached=None,
            bias=None, activation=None):
    """One pass: ``types`` ``(a, b)`` (``b`` None: not gated); ``cached``: ``(slot of each
    expert [E], cache's a, cache's b)``, an expert with a slot read there instead;
    ``bias``: ``[E, n]`` (gated: ``[E, 2n]``, the up's half second) added to the sums;
    ``activation``: the clamped SwiGLU of a gated pass."""
    gated = wb is not None
    wb = wa if wb is None else wb
    n, k, r = wa.shape[1], x.shape[1], out.shape[0]
    args = (x, wa, wb, out, out if route_weights is None else route_weights)
    slot_of, ca, cb = cached if cached is not None else (out, wa, wb)
    cb = ca if cb is None else cb
    tiers = (slot_of, ca.data_ptr() - wa.data_ptr(), cb.data_ptr() - wb.data_ptr(),
             out if bias is None else bias.contiguous(), 0 if bias is None else bias.shape[1], wa.shape[1],
             0.0 if activation is None else activation.alpha, 0.0 if activation is None else activation.limit)
    shape = (r, top_k, n, k, wa.stride(0), wb.stride(0), wa.stride(1), wb.stride(1), x.stride(0), out.stride(0))
    consts = {**_prefixed("A", types[0]), **_prefixed("B", types[1] or types[0]),
              "GATED": gated, "WEIGHTED": route_weights is not None, "CACHED": cached is not None,
              "BIASED": bias is not None, "CLAMPED": activation is not None}
    if gemv is not None:
        _moe_gemv_kernel[(r * triton.cdiv(n, block_n),)](*args, gemv, *tiers, *shape, **consts, BLOCK_N=block_n,
                                                          ASM=ptx_enabled(x.device), num_warps=num_warps)
        return
    sorted_rows, block_experts, num_padded, block_m = sort
    grid = (sorted_rows.numel() // block_m, triton.cdiv(n, block_n))
    asm = ptx_enabled(x.device)
    _moe_gemm_kernel[grid](*args, sorted_rows, block_experts, num_padded, *tiers, *shape, **consts, BLOCK_M=block_m,
                           BLOCK_N=block_n, IEEE=x.dtype == torch.float32 or INTERPRETING,
                           A_PACKED=_packed(types[0], x, asm), B_PACKED=gated and _packed(types[1], x, asm), ASM=asm,
                           num_warps=num_warps)


def _packed(type_name: str, x: torch.Tensor, asm: bool) -> bool:
    """Whether the sorted GEMM decodes ``type_name``'s experts with the packed GEMM's
    decode (:mod:`kernels.quant.triton_packed_gemm`): one of its types, the
    ``quant_gemm_packed`` switch on, and bfloat16 rows with the PTX on (as the dense
    block GEMM chooses it); in Triton's interpreter its float32 twin, any rows."""
    return (type_name in PACKED_TYPES and current().quant_gemm_packed
            and (INTERPRETING or (asm and x.dtype == torch.bfloat16)))


def fused_moe_quant(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    types: tuple[str, str, str],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    slot_of: torch.Tensor | None = None,
    method: str | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    biases: ExpertBiases | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.moe.quant_reference.fused_moe_quant` (``biases``
    and ``activation`` included: added and applied in the kernels' epilogues). With
    ``cache``, the stacks may be in pinned host memory while ``x`` is on the device: both
    kernels read an expert over the bus (one address space), or from its cache slot;
    nothing is copied and nothing read back (the GEMV's call can be captured).

    Args (beyond it, for tests and sweeps):
        method: ``"gemv"`` or ``"gemm"``; default the GEMV for up to
            :data:`GEMV_MAX_TOKENS` tokens.
        block_n: weight rows per program (default 4 for the GEMV, 64 for the GEMM).
        block_m: sorted rows per GEMM program (default as :mod:`kernels.moe.triton_kernel`).
        num_warps: default 4 for the GEMV, 8 for the GEMM.

    Transient memory: the activations ``[R, I]`` and the weighted down products
    ``[R, H]`` in ``x``'s dtype, ``R = T * K``; for the GEMM also the sort
    (:func:`kernels.moe.reference.align_to_blocks`).

    Raises:
        ValueError: blocks that do not match ``types`` and ``x``'s width, or an unknown
            ``method``.
    """
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    rows = tokens * top_k
    inter = w_gate.shape[1]
    check_expert_blocks(w_gate, w_up, w_down, types, hidden, inter)
    check_cache(cache, slot_of, w_gate, w_up, w_down, biases)
    if rows == 0:
        return torch.zeros_like(x)
    method = method or ("gemv" if tokens <= GEMV_MAX_TOKENS else "gemm")
    if method not in ("gemv", "gemm"):
        raise ValueError(f"method must be 'gemv' or 'gemm', got {method!r}")
    x = x.contiguous()
    gemv = sort = None
    if method == "gemv":
        gemv = topk_ids.reshape(-1).contiguous()
    else:
        bm = block_m or _block_m(rows)
        sort = (*align_to_blocks(topk_ids, w_gate.shape[0], bm), bm)
    # The GEMM's gated pass holds two 64 x 64 float32 accumulators: 8 warps keep them in
    # registers (4 spill on sm_90, tests/triton_moe_quant_compile_check.py).
    common = dict(top_k=top_k, gemv=gemv, sort=sort, block_n=block_n or (4 if gemv is not None else 64),
                  num_warps=num_warps or (4 if gemv is not None else 8))
    act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    _launch(x, w_gate, w_up, act, None, types[:2], **common,
            cached=None if cache is None else (slot_of, cache[0], cache[1]),
            bias=None if biases is None else biases.gate_up, activation=activation)
    down = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    _launch(act, w_down, None, down, topk_weights.reshape(-1).contiguous(), (types[2], None), **common,
            cached=None if cache is None else (slot_of, cache[2], None), bias=None if biases is None else biases.down)
    return down.view(tokens, top_k, hidden).sum(dim=1)
