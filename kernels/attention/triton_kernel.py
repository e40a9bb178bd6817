"""Paged attention in Triton: decode with split-K and grouped-query heads, and ragged
prefill/extend over a cached prefix. Same signatures and results as the references in
:mod:`kernels.attention.reference` (tested against them, on the CPU under ``TRITON_INTERPRET=1``).

Both kernels read every key and value from the pool through the page table (the new
tokens' K/V are stored before the call), use the online softmax of FlashAttention
(Dao et al., 2022; Milakov & Gimelshein, 2018) in base 2, and accumulate in float32.

Decode. One program per (sequence, KV head, split): the program loads the ``H / H_kv``
query heads that share its KV head as the rows of one ``tl.dot`` tile, so each key is
read once per group, not once per query head. Split-K (FlashDecoding, Dao et al., 2023)
cuts each context into ``num_splits`` ranges so that a small batch still fills the
GPU; a second kernel merges the ranges by their log-sum-exp. The split count depends
only on the batch shape, never on sequence lengths, so one CUDA graph captured for a
batch size serves every context length; ranges past a sequence's end cost one early
exit. Rows with ``seq_len == 0`` (graph padding) give zeros.

Extend. One program per (block of a sequence's new tokens, query head, sequence);
blocks beyond a sequence's extend do no work. A block loops over the keys up to its
last row's position only (the causal bound), prefix included.

The pool. An FP8 pool (scale 1.0) is upcast as each tile is loaded. A pool of
llama.cpp's blocks (``--kv-cache-dtype q8_0``/``q4_0``, :mod:`kernels.attention.kv_store`)
is dequantized the same way, tile by tile inside the kernel: each value's code and its
block's float16 scale (two bytes, put together as little-endian) are loaded from the
row's bytes and multiplied in float32, as the reference's gather does, so only the keys
and values a program reads are ever turned into floats.

Scores are soft-capped (``softcap``) as each tile is scored, before the mask. A head's
sink (``sinks``) joins a row's softmax once: the running max and sum start from it, or
with split-K the merge adds it to the ranges' sum (never a range).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention.kv_formats import KV_BLOCK, KV_BLOCK_BYTES
from kernels.attention.kv_store import block_format
from kernels.quant.triton_activations import GROUP, producer_activations, producer_args, q8_groups

_LOG2E = 1.4426950408889634
_L2E = tl.constexpr(_LOG2E)

# Split-K aims for about this many programs per decode launch (an H200 has 132 SMs);
# more splits than this cost merge work for nothing.
_TARGET_PROGRAMS = 512
MAX_SPLITS = 16


def decode_num_splits(batch_size: int, num_kv_heads: int) -> int:
    """Context ranges per sequence for a decode launch of this shape (1 .. MAX_SPLITS)."""
    return max(1, min(MAX_SPLITS, _TARGET_PROGRAMS // max(batch_size * num_kv_heads, 1)))


def decode_workspace_bytes(max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of the split-K partials (float32 outputs and log-sum-exps) for any decode
    batch up to ``max_batch``: the most that :func:`paged_decode` ever needs."""
    most = max(b * decode_num_splits(b, num_kv_heads) for b in range(1, max_batch + 1))
    return most * num_heads * (head_dim + 1) * 4


def decode_config(dtype: torch.dtype, head_dim: int, kv_blocks: bool = False) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of the decode kernel; ``kv_blocks``: over a pool of
    q8_0/q4_0 blocks, whose tiles hold each value's byte offsets and scale as well.

    Chosen so that no configuration spills registers on sm_90 (``ptxas -v``; checked by
    the tests): a kernel with a stack frame makes the driver reserve that frame for
    every thread the GPU can hold (on an H200, 132 SMs x 2048 threads), for the rest of
    the process. A 10 KB frame cost 2.6 GiB of device memory that no allocator sees.
    Over blocks, (64, 4) spilled 32 bytes at D=64 and (64, 8) 40 at D=128 (q8_0).
    """
    if kv_blocks:
        return (32, 8)
    return (64, 4) if head_dim <= 64 and dtype != torch.float32 else (64, 8)


def extend_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the extend kernel; no spills, as for
    :func:`decode_config`. Float32 tiles hold twice the registers of 16-bit ones."""
    wide = dtype == torch.float32
    if head_dim <= 64:
        return (64, 32, 8) if wide else (64, 64, 8)
    return (32, 32, 8) if wide else (64, 32, 8)


def _group_block(group: int) -> int:
    # tl.dot wants at least 16 rows.
    return max(16, triton.next_power_of_2(group))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through TF32 (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


# The kernels' KV_FMT: how a pool buffer's rows hold their values.
_KV_FMTS = {None: 0, "q8_0": 1, "q4_0": 2}
_BLOCK = tl.constexpr(KV_BLOCK)
_Q8_0_BYTES = tl.constexpr(KV_BLOCK_BYTES["q8_0"])
_Q4_0_BYTES = tl.constexpr(KV_BLOCK_BYTES["q4_0"])


def _kv_fmt(buf: torch.Tensor) -> int:
    return _KV_FMTS[block_format(buf.dtype)]


@triton.jit
def _load_kv(Buf, row, d, mask, KV_FMT: tl.constexpr):
    """The ``[N, BLOCK_D]`` values at element ``d`` of the head rows starting at
    ``row`` (``[N]`` offsets into ``Buf``): as stored (KV_FMT 0), or dequantized from
    q8_0 (1) or q4_0 (2) blocks in float32."""
    if KV_FMT == 0:
        x = tl.load(Buf + row[:, None] + d[None, :], mask=mask, other=0.0)
    else:
        # Each value's block starts with its scale; the codes follow it.
        if KV_FMT == 1:
            first = row[:, None] + (d // _BLOCK * _Q8_0_BYTES)[None, :]
            codes = tl.load(Buf + first + 2 + (d % _BLOCK)[None, :], mask=mask, other=0).to(tl.float32)
        else:
            first = row[:, None] + (d // _BLOCK * _Q4_0_BYTES)[None, :]
            byte = tl.load(Buf + first + 2 + (d % (_BLOCK // 2))[None, :], mask=mask, other=0)
            codes = tl.where((d % _BLOCK < _BLOCK // 2)[None, :], byte & 15, byte >> 4).to(tl.float32) - 8.0
        lo = tl.load(Buf + first, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
        hi = tl.load(Buf + first + 1, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
        x = codes * (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _attend_block(
    q, K, V, PageTable, pt_row, pos, nmask, visible, kvh, d, dmask, m_i, l_i, acc,
    stride_ks, stride_kh, stride_vs, stride_vh, scale_log2, cap_log2,
    PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr, KV_FMT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One online-softmax step over the keys at positions ``pos`` of one sequence;
    ``visible`` ([rows, N]) masks the scores, capped at ``cap_log2`` (base 2) with
    ``SOFTCAP``. Returns the updated (max, sum, acc)."""
    page = tl.load(PageTable + pt_row + pos // PAGE_SIZE, mask=nmask, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    kv_mask = nmask[:, None] & dmask[None, :]
    # An FP8 pool (scale 1.0) is upcast to the queries' dtype as it is loaded, a block pool dequantized.
    k = _load_kv(K, slot * stride_ks + kvh * stride_kh, d, kv_mask, KV_FMT).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if SOFTCAP:
        # cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends of the range.
        s = cap_log2 * (1.0 - 2.0 / (tl.exp2(s / cap_log2 * (2.0 * _L2E)) + 1.0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet (a sliding window starting past this block)
    # keeps max -inf: exponents taken against 0 then, so they give 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv(V, slot * stride_vs + kvh * stride_vh, d, kv_mask, KV_FMT).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    Q, K, V, PageTable, SeqLens, Out, PartO, PartLse, Sinks,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_ob, stride_oh,
    scale_log2, window, cap_log2,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = 0,
    KV_FMT: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0, SINKS: tl.constexpr = 0,
):
    # PDL (kernels.pdl): launched while the kernel that stored this step's K/V ends.
    pdl.begin(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    # A sliding-window layer (window > 0) reads its last `window` keys only.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SINKS and NUM_SPLITS == 1:  # with splits, the merge adds the sinks
        m_i, l_i = tl.load(Sinks + heads, mask=gmask, other=0.0).to(tl.float32) * _L2E, l_i + 1.0
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        m_i, l_i, acc = _attend_block(
            q, K, V, PageTable, b * stride_pt, pos, nmask, nmask[None, :], kvh, d, dmask, m_i, l_i, acc,
            stride_ks, stride_kh, stride_vs, stride_vh, scale_log2, cap_log2, PAGE_SIZE, PRECISION, KV_FMT, SOFTCAP,
        )

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                 mask=gmask[:, None] & dmask[None, :])
    else:
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split  # [G]
        tl.store(PartO + row[:, None] * HEAD_DIM + d[None, :], o, mask=gmask[:, None] & dmask[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + row, lse, mask=gmask)


@triton.jit
def _merge_kernel(
    PartO, PartLse, Out, Codes, Scales, Sums, Sinks, stride_ob, stride_oh, stride_q, stride_d, stride_s,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, QUANT: tl.constexpr = 0, PDL: tl.constexpr = 0,
    SINKS: tl.constexpr = 0,
):
    # QUANT: the output row also quantized for the o projection's int8 GEMV into
    # Codes/Scales/Sums; a head's HEAD_DIM values (== BLOCK_D, whole groups of 32) are
    # its own groups, so each program quantizes the values it writes.
    pdl.begin(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    smask = s < NUM_SPLITS
    lse = tl.load(PartLse + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:  # the head's sink: once in the sum of the ranges' softmax sums
        sink = tl.load(Sinks + h).to(tl.float32) * _L2E
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty ranges
    o = tl.load(PartO + row[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    stored = out.to(Out.dtype.element_ty)
    tl.store(Out + b * stride_ob + h * stride_oh + d, stored, mask=d < HEAD_DIM)
    if QUANT:
        # From the value as stored, as the quantizing launch would load it.
        groups: tl.constexpr = HEAD_DIM // 32
        q8_groups(tl.reshape(stored.to(tl.float32), (groups, 32)), Codes + b * stride_q, Scales + b * stride_d,
                   Sums + b * stride_s, h * groups + tl.arange(0, groups), NUM_HEADS * groups)


def paged_decode(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    quantize: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Triton version of :func:`kernels.attention.reference.paged_decode_ref` (same arguments and
    result; ``seq_lens`` and ``page_table`` on the device).

    With ``quantize``: ``(out, q8)``, ``q8`` the rows ``out.view(B, H * D)`` quantized for
    the int8 GEMV of the o projection by the split merge as it writes them
    (:class:`kernels.quant.triton_activations.Q8Activations`, equal to
    ``quantize_activations`` of those rows bit for bit), or None where the launch cannot
    (one split, so no merge; ``D`` not a power of two of whole groups of 32): the
    caller then quantizes them apart.

    Args:
        out: ``[B, H, D]`` to write into (else allocated).
        workspace: float32, at least :func:`decode_workspace_bytes` for this batch (else
            allocated when split-K needs it). Pass a persistent one under CUDA graphs.
        num_splits: context ranges per sequence (default :func:`decode_num_splits`).
        block_n: keys per loop iteration (default: :func:`decode_config`).
        window: a sliding-window layer's window (the reference's ``window``; 0: the
            whole context); the ranges split the window only.
        softcap, sinks: the reference's (0, None: none); ``sinks`` ``[H]`` on the device.

    Raises:
        ValueError: ``H`` is not a multiple of ``H_kv``, or the workspace is too small.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    splits = num_splits or decode_num_splits(batch, num_kv_heads)
    if out is None:
        out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    fused = quantize and splits > 1 and head_dim == block_d and head_dim % GROUP == 0 and out.is_contiguous()
    q8 = producer_activations(out.view(batch, num_heads * head_dim), True) if fused else None
    if batch == 0:
        return (out, q8) if quantize else out
    part_o = part_lse = out  # unused when splits == 1
    if splits > 1:
        need = batch * num_heads * splits * (head_dim + 1)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        if workspace.numel() < need:
            raise ValueError(f"decode workspace holds {workspace.numel()} floats, {need} needed")
        part_o = workspace[: batch * num_heads * splits * head_dim]
        part_lse = workspace[batch * num_heads * splits * head_dim : need]
    default_n, warps = decode_config(q.dtype, head_dim, kv_blocks=_kv_fmt(k_buf) > 0)
    block_n = block_n or default_n
    sink_arg = out if sinks is None else sinks.contiguous()  # unused without sinks
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_buf, v_buf, page_table, seq_lens, out, part_o, part_lse, sink_arg,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1), scale * _LOG2E, window, softcap * _LOG2E,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=_group_block(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=splits, PRECISION=_dot_precision(q.dtype),
        KV_FMT=_kv_fmt(k_buf), SOFTCAP=softcap > 0, SINKS=sinks is not None, num_warps=warps,
        **pdl.launch_args(q.device),
    )
    if splits > 1:
        quant, quant_strides = producer_args(q8, out)
        _merge_kernel[(batch, num_heads)](
            part_o, part_lse, out, *quant, sink_arg, out.stride(0), out.stride(1), *quant_strides,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), QUANT=q8 is not None, SINKS=sinks is not None,
            num_warps=2, **pdl.launch_args(q.device),
        )
    return (out, q8) if quantize else out


@triton.jit
def _extend_kernel(
    Q, K, V, PageTable, QStarts, PrefixLens, ExtendLens, Out, Sinks,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_ot, stride_oh,
    scale_log2, window, cap_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FMT: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0, SINKS: tl.constexpr = 0,
):
    mblk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    ext = tl.load(ExtendLens + b).to(tl.int32)
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(QStarts + b).to(tl.int64)
    seq_len = prefix + ext
    kvh = h // GROUP

    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < ext
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_pos = prefix + m
    q = tl.load(Q + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    # Keys up to the block's last row (causal); nothing when the block lies past the extend.
    hi = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    hi = tl.where(mblk * BLOCK_M < ext, hi, 0)

    # A sliding-window layer (window > 0): row q_pos sees keys q_pos - window < j <= q_pos;
    # the block's keys start at its first row's first visible one.
    lo = tl.where(window > 0, tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # the head's sink: a first column that adds no value
        m_i, l_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + h).to(tl.float32) * _L2E, l_i + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < hi
        visible = (pos[None, :] <= q_pos[:, None]) & nmask[None, :]
        visible = visible & ((window == 0) | (pos[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = _attend_block(
            q, K, V, PageTable, b * stride_pt, pos, nmask, visible, kvh, d, dmask, m_i, l_i, acc,
            stride_ks, stride_kh, stride_vs, stride_vh, scale_log2, cap_log2, PAGE_SIZE, PRECISION, KV_FMT, SOFTCAP,
        )

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


def paged_extend(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    max_extend: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kernels.attention.reference.paged_extend_ref` (same arguments and
    result; the index tensors on the device).

    Args:
        max_extend: the largest ``extend_lens`` entry (known on the host; sizes the grid).
        out: ``[T, H, D]`` to write into (else allocated).
        block_m, block_n: query rows and keys per tile (default: :func:`extend_config`).
        window: a sliding-window layer's window (the reference's ``window``; 0: none).
        softcap, sinks: the reference's (0, None: none); ``sinks`` ``[H]`` on the device.

    Raises:
        ValueError: ``H`` is not a multiple of ``H_kv``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(q)
    batch = extend_lens.shape[0]
    if batch == 0 or max_extend == 0:
        return out
    default_m, default_n, warps = extend_config(q.dtype, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    grid = (math.ceil(max_extend / block_m), num_heads, batch)
    _extend_kernel[grid](
        q, k_buf, v_buf, page_table, q_starts, prefix_lens, extend_lens, out,
        out if sinks is None else sinks.contiguous(),  # unused without sinks
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1), scale * _LOG2E, window, softcap * _LOG2E,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype),
        KV_FMT=_kv_fmt(k_buf), SOFTCAP=softcap > 0, SINKS=sinks is not None, num_warps=warps,
    )
    return out
