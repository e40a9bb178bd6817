"""Decode GEMV over Q4_K/Q6_K blocks with int8 activations and integer dot products.

The float GEMV (:func:`kernels.quant.triton_kernel.quant_gemv`) turns every weight into
a float32 and multiplies it: about 6.7 instructions a Q4_K weight, so it is bound by
instruction issue, not by HBM. Here, as llama.cpp's MMVQ kernels do, the activation
row is quantized (int8 codes, one float32 scale per 32 values, ``scale = amax / 127``,
codes rounded half away from zero, and the codes' sum per 16 values), and each 32-bit
word of weight codes is multiplied by a word of activation codes with one ``dp4a``
(four int8 products summed into an int32; PTX ``dp4a.s32.s32``, emulated with shifts in
Triton's interpreter):

- Q4_K: a word of ``qs`` holds 4 codes of sub-block ``2r`` (low nibbles) and 4 of
  ``2r + 1`` (high nibbles); two masks and a shift make two int8 words, two ``dp4a``
  take 8 weights. Per sub-block (32 weights) and row:
  ``d * sc * dot * dx - dmin * mn * dx * sum(codes)``.
- Q6_K: a word of ``ql``'s first 32 bytes of a half, the word 32 bytes on and the word
  of ``qh`` at the same place hold 16 codes of four sub-blocks (ggml's
  ``dequantize_row_q6_K`` order); masks and shifts put the two high bits under each
  nibble. The codes are ``0..63`` with zero point 32, taken off through the
  activations' sum: ``d * sc * (dot - 32 * sum(codes)) * dx`` per sub-block of 16.
  Blocks are 210 bytes, so their words are read as two 16-bit halves.

Counting the source's operations, the dot products take 0.6 instructions a Q4_K
weight (the float GEMV about 6.7), about two a Q6_K weight. The activations are rounded
to int8 (llama.cpp does the same; the error is at most half a code step, ``amax / 254``
of each group of 32), so results differ from the float GEMV by that rounding;
:func:`kernels.quant.reference.quant_matmul_int8` is the exact reference of this
arithmetic. Block layouts as ggml-common.h's ``block_q4_K``/``block_q6_K``; the scheme
as llama.cpp's ``quantize_q8_1`` and ``vec_dot_q4_K_q8_1``/``vec_dot_q6_K_q8_1``.

Where the rows are quantized: llama.cpp quantizes them in a launch of their own
(:func:`quantize_activations`), and so does :func:`int8_gemv` by default (given its
codes), unless the kernel that wrote the rows quantized them as it did (the decoder's
norms and SiLU-and-mul, ``quantize=True``, through :func:`_q8_groups`, the same code). Given the float rows it quantizes them itself (``QUANT_X``; one launch less per
projection, each 2-4 us in a CUDA graph, but measured slower, so off by default,
``HEADROOM_QUANT_INT8_FUSE=1``): each program, at each step, loads the float activations of its
``KB`` blocks once, quantizes every group of 32 with :func:`_quantize_kernel`'s own
arithmetic (:func:`_q8_inv`, :func:`_q8_round`, :func:`_q8_scale`: the same codes and
scales bit for bit, so the same results at the same tiling) in a tile of its own whose
activations are spread over the program's threads (each rounded once), and the codes
go to the weight tile's layout through shared memory for all ``BLOCK_N`` rows; the
codes' sums are counted with the products (a second ``dp4a`` with ``0x01010101``).
Every program so quantizes its own slice of the row (the quantizing launch did it once
for all of them), work that more rows a program share: hence tilings tried only in
this mode (:data:`_QUANT_X_TILINGS`).

A fused projection whose parts differ in type (a Q4_K_M file's q and k in Q4_K over v in
Q6_K) is one launch too (:func:`int8_gemv_parts`): the first part's weight tiles, then
the second's, each program of one part (a branch on its tile, both types compiled in),
so each part's columns are what its own launch gives at the same tiling.

Tiling: one program per (activation row, ``BLOCK_N`` weight rows, range of K), ``KB``
blocks per step in a ``[BLOCK_N, KB, 4, words]`` tile whose rows come first, so a thread
holds the same words of several rows and loads the activation words once for them
(``SPLIT``, Q4_K: each run of 8 words as two 4-word tiles, so one thread holds a whole
run); Q4_K's 16-byte header is read as four words. Autotuned per (N, K, type, mode,
second part); split-K below two rows per SM, as the float GEMV. Triton gives a step's
values the layout of whichever tile's loads it propagates first, the last issued: a
step reads its activations before its weight words so that the weight tile's layout
wins (the activations are moved, not the weights; the accumulator, hence the order of
the final sums, the same in both modes).

Q6_K rows are read from their repacked planes (``Q6_K_P``, :mod:`kernels.quant.repack`)
as whole, aligned words; each step can load the next step's words before its own
arithmetic (``PREFETCH``, a tuned choice). On the H200 this is the default decode
GEMV for Q4_K/Q6_K (README, "GGUF weights kept quantized";
``HEADROOM_QUANT_INT8=0`` turns it off).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.formats import block_format
from kernels.quant.triton_kernel import _ASM, _INTERPRETING, _f16, _output, _sm_count

# The block types with an integer-dot GEMV (Q6_K_P: Q6_K repacked, kernels.quant.repack).
INT8_TYPES = ("Q4_K", "Q6_K", "Q6_K_P")
# Activations per int8 scale (llama.cpp's block_q8_1), and per code sum.
GROUP = 32
SUM_GROUP = 16


class Q8Activations(NamedTuple):
    """Activation rows quantized for :func:`int8_gemv` (:func:`quantize_activations`).

    Attributes:
        codes: int8 ``[M, K]``; ``x ~= codes * scale`` of their group of 32.
        scales: float32 ``[M, K / 32]``.
        sums: int32 ``[M, K / 16]``, the codes' sum per 16.
        dtype: the activations' dtype (the GEMV's output dtype).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor
    dtype: torch.dtype


@triton.jit
def _q8_inv(amax):
    """``127 / amax`` per group (0 for a group of zeros), float32 of ``amax``'s shape.
    Shared by :func:`_quantize_kernel` and the GEMV's ``QUANT_X`` mode, so both round
    the same way; correctly rounded (Triton's ``/`` is approximate), so the codes equal
    the torch reference's bit for bit."""
    return tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)


@triton.jit
def _q8_scale(amax):
    """The float32 scale ``amax / 127`` of a group (correctly rounded, as :func:`_q8_inv`)."""
    return tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def _q8_round(v):
    """int32 codes of ``v = x * 127 / amax``, rounded half away from zero (``quantize_q8_1``'s
    ``roundf``)."""
    return tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)


@triton.jit
def _q8_groups(x, q_row, d_row, s_row, g1, groups):
    """Quantize groups of 32 activations of one row and store them as
    :class:`Q8Activations` hold them: ``x`` float32 ``[G, 32]`` (row ``i`` is group
    ``g1[i]``, ``g1`` int32 ``[G]``), ``q_row``/``d_row``/``s_row`` that row's codes (int8),
    scales (float32) and sums (int32); groups ``>= groups`` are not stored. The one place
    the codes are made: :func:`_quantize_kernel` and the kernels that write a row and
    quantize it as they do (:mod:`kernels.norm.triton_kernel`, :mod:`kernels.activation.triton_kernel`)
    call it, so they give the same codes, scales and sums bit for bit from the same
    float32 values."""
    g = g1[:, None]
    t = tl.arange(0, 32)[None, :]
    amax = tl.max(tl.abs(x), axis=1)
    q = _q8_round(x * _q8_inv(amax)[:, None])
    tl.store(q_row + g * 32 + t, q.to(tl.int8), mask=g < groups)
    live = g1 < groups
    tl.store(d_row + g1, _q8_scale(amax), mask=live)
    tl.store(s_row + 2 * g1, tl.sum(tl.where(t < 16, q, 0), axis=1), mask=live)
    tl.store(s_row + 2 * g1 + 1, tl.sum(tl.where(t >= 16, q, 0), axis=1), mask=live)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, s_ptr, groups, stride_xm, stride_qm, stride_dm, stride_sm, G: tl.constexpr,
                     PDL: tl.constexpr = 0):
    pdl.begin(PDL)  # the GEMV after it may load its first weights meanwhile
    m = tl.program_id(0).to(tl.int64)
    g1 = tl.program_id(1) * G + tl.arange(0, G)
    t = tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m * stride_xm + g1[:, None] * 32 + t, mask=g1[:, None] < groups, other=0.0).to(tl.float32)
    _q8_groups(x, q_ptr + m * stride_qm, d_ptr + m * stride_dm, s_ptr + m * stride_sm, g1, groups)


def empty_activations(m: int, k: int, device: torch.device, dtype: torch.dtype) -> Q8Activations:
    """Uninitialized :class:`Q8Activations` for ``m`` rows of ``k`` activations of
    ``dtype`` (a kernel writes them: :func:`quantize_activations`, or the norm or
    activation kernel that makes the rows, ``quantize=True``).

    Raises:
        ValueError: ``k`` not a multiple of 32 (a scale's group).
    """
    if k % GROUP:
        raise ValueError(f"int8 activations come in groups of {GROUP}: a row of {k} is not whole groups")
    groups = k // GROUP
    return Q8Activations(torch.empty((m, k), device=device, dtype=torch.int8),
                         torch.empty((m, groups), device=device, dtype=torch.float32),
                         torch.empty((m, 2 * groups), device=device, dtype=torch.int32), dtype)


def producer_activations(out: torch.Tensor, quantize: bool) -> Q8Activations | None:
    """For a kernel that writes the rows ``out [rows, K]`` and, asked to (``quantize``),
    quantizes them as it does (:mod:`kernels.norm.triton_kernel`,
    :mod:`kernels.activation.triton_kernel`): the buffers it fills, else None.

    Raises:
        ValueError: ``quantize`` and ``K`` not a multiple of 32.
    """
    if not quantize:
        return None
    if out.shape[1] % GROUP:
        raise ValueError(f"quantize=True needs rows of whole groups of {GROUP} activations, got {out.shape[1]}")
    return empty_activations(*out.shape, out.device, out.dtype)


def producer_args(q8: Q8Activations | None, stand_in: torch.Tensor) -> tuple[tuple, tuple]:
    """Such a kernel's codes, scales and sums arguments and their row strides; without
    ``q8`` it leaves them unused (its ``QUANT`` off) and ``stand_in`` fills them."""
    if q8 is None:
        return (stand_in, stand_in, stand_in), (0, 0, 0)
    quant = (q8.codes, q8.scales, q8.sums)
    return quant, tuple(t.stride(0) for t in quant)


def quantize_activations(x: torch.Tensor) -> Q8Activations:
    """``x [M, K]`` (float32/bfloat16/float16, unit column stride, ``K % 32 == 0``) to
    int8 codes with a float32 scale per 32 values (:class:`Q8Activations`); the torch
    twin is :func:`kernels.quant.reference.quantize_activations`.

    Raises:
        ValueError: ``x`` not 2-D with whole groups of 32 and a unit column stride.
    """
    if x.dim() != 2 or x.shape[1] % GROUP or x.stride(1) != 1:
        raise ValueError(f"want x [M, K] with K a multiple of {GROUP} and unit column stride, got {tuple(x.shape)}")
    m, k = x.shape
    groups = k // GROUP
    q8 = empty_activations(m, k, x.device, x.dtype)
    g = 32
    _quantize_kernel[(m, triton.cdiv(groups, g))](x, q8.codes, q8.scales, q8.sums, groups, x.stride(0),
                                                  q8.codes.stride(0), q8.scales.stride(0), q8.sums.stride(0), G=g,
                                                  num_warps=4, **pdl.launch_args(x.device))
    return q8


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Per element, the sum of the four products of the signed bytes of int32 ``a`` and
    ``b`` (PTX ``dp4a``; shifts in the interpreter)."""
    if ASM:
        r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        r = ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
        r += ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24)
    return r


@triton.jit
def _dot_sum(w, x, ASM: tl.constexpr, SUMS: tl.constexpr):
    """``(dot, sums)``: the :func:`_dp4a` of weight words ``w`` and activation words ``x``
    summed over the last axis, and with ``SUMS`` the sum of ``x``'s codes (its signed
    bytes) over it, else 0. ``QUANT_X`` counts the sums here, in one instruction with
    the products (``dp4a`` with ``0x01010101``), so they are computed in the weight
    tile's layout, where the scales use them, rather than moved there."""
    if SUMS:
        if ASM:
            ones = tl.full(w.shape, 0x01010101, tl.int32)
            d, c = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $2, $3, 0; dp4a.s32.s32 $1, $4, $3, 0;",
                                             "=r,=r,r,r,r", [w, x, ones], dtype=(tl.int32, tl.int32), is_pure=True,
                                             pack=1)
        else:
            d = _dp4a(w, x, ASM)
            c = ((x << 24) >> 24) + ((x << 16) >> 24) + ((x << 8) >> 24) + (x >> 24)
        dot = tl.sum(d, axis=3)
        sums = tl.sum(c, axis=3)
    else:
        dot = tl.sum(_dp4a(w, x, ASM), axis=3)
        sums = 0
    return dot, sums


@triton.jit
def _word16(p):
    """The int32 of two little-endian 16-bit halves at ``p`` (int16 pointers)."""
    return (tl.load(p).to(tl.int32) & 0xFFFF) | (tl.load(p + 1).to(tl.int32) << 16)


@triton.jit
def _k_scales_words(w1, w2, w3, S):
    """Q4_K's 6-bit scale and min of sub-block ``S`` (a tensor) as float32, from the 12
    scale bytes read as three int32 words (``get_scale_min_k4``: sub-blocks 4-7 take
    their high bits from the top two bits of sub-blocks 0-3's bytes)."""
    sh = 8 * (S % 4)
    b1 = w1 >> sh
    b2 = w2 >> sh
    b3 = w3 >> sh
    sc = tl.where(S < 4, b1 & 63, (b3 & 15) | (((b1 >> 6) & 3) << 4))
    mn = tl.where(S < 4, b2 & 63, ((b3 >> 4) & 15) | (((b2 >> 6) & 3) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4k_words(w32, w32_3, kb, kb3, SPLIT: tl.constexpr):
    """The weight words of Q4_K blocks ``kb`` of the rows at ``w32`` (``[BLOCK_N, 1, 1, 1]``
    int32 row pointers; ``w32_3`` the same ``[BLOCK_N, 1, 1]``): ``(wa, wb, h0, h1, h2,
    h3)``, run ``r`` of each block's ``qs`` (sub-blocks ``2r`` and ``2r + 1``; with
    ``SPLIT`` its 8 words as two 4-word tiles, else ``wa`` holds all 8 and ``wb`` is
    ``wa``) and the 16-byte header as four words (d and dmin, 12 scale bytes: four loads
    per (row, block) instead of a byte load per scale, measured 36 against 53 us on the
    gate/up shape). Loads only, so a step can issue the next blocks' before it multiplies."""
    r = tl.arange(0, 4)[None, None, :, None]
    if SPLIT:
        # A thread holds a run's 8 words (two 16-byte loads), so its sums and scales are
        # neither shuffled nor computed again by a second thread.
        wp = w32 + kb * 36 + 4 + 8 * r + tl.arange(0, 4)[None, None, None, :]
        wa = tl.load(wp)
        wb = tl.load(wp + 4)
    else:
        wa = tl.load(w32 + kb * 36 + 4 + 8 * r + tl.arange(0, 8)[None, None, None, :])  # 36 words, qs from word 4
        wb = wa
    hdr = w32_3 + kb3 * 36  # [BLOCK_N, KB, 1] word pointers
    return wa, wb, tl.load(hdr), tl.load(hdr + 1), tl.load(hdr + 2), tl.load(hdr + 3)


@triton.jit
def _x_load(x, e, live):
    """``QUANT_X``: activations of the float row at ``x`` as float32, at element offsets
    ``e`` (``[1, KB, A, words, 4]``, four consecutive elements a word; zero in blocks not
    ``live``, ``[1, KB, 1, 1]``), and their largest magnitude per ``[1, KB, A]``."""
    v = tl.load(x + e, mask=live[:, :, :, :, None], other=0.0).to(tl.float32)
    return v, tl.max(tl.max(tl.abs(v), axis=4), axis=3)


@triton.jit
def _x_pack(v, amax):
    """``QUANT_X``: the activations ``v`` of :func:`_x_load` quantized with their group's
    ``amax`` (``[1, KB, A]``) as :func:`_quantize_kernel` quantizes them, as the int32
    words of four codes :func:`int8_gemv` would read from its codes (``[1, KB, A, words]``)."""
    q = _q8_round(v * _q8_inv(amax)[:, :, :, None, None])
    byte = tl.arange(0, 4)[None, None, None, None, :]
    # Little-endian bytes, disjoint: their sum is the word (the top byte's sign bits
    # fall off it).
    return tl.sum((q & 0xFF) << (8 * byte), axis=4)


@triton.jit
def _q4k_act(x32, xd, xs, kb, kb3, live, live3, HALF: tl.constexpr, SPLIT: tl.constexpr, QUANT_X: tl.constexpr):
    """The activations of sub-blocks ``2r + HALF`` (a group of 32) of blocks ``kb``, for
    :func:`_q4k_dot`: ``(xa, xb, dx, sums)``, the group's code words (with ``SPLIT`` its
    8 words as two ``[1, KB, 4, 4]`` tiles, else ``xa`` ``[1, KB, 4, 8]`` holds them and
    ``xb`` is ``xa``), its scale and its codes' sum (``[1, KB, 4]``). Read from the
    quantized row, or with ``QUANT_X`` quantized here from the float row at ``x32`` (the
    sums then 0: the dot counts them); dead blocks give zeros (scale 0)."""
    r = tl.arange(0, 4)[None, None, :, None]
    if QUANT_X:
        w = tl.arange(0, 4 if SPLIT else 8)[None, None, None, :, None]
        e = (kb * 256 + 64 * r + 32 * HALF)[:, :, :, :, None] + 4 * w + tl.arange(0, 4)[None, None, None, None, :]
        if SPLIT:
            va, ma = _x_load(x32, e, live)
            vb, mb = _x_load(x32, e + 16, live)
            amax = tl.maximum(ma, mb)
            xa = _x_pack(va, amax)
            xb = _x_pack(vb, amax)
        else:
            v, amax = _x_load(x32, e, live)
            xa = _x_pack(v, amax)
            xb = xa
        dx = _q8_scale(amax)
        sums = 0  # counted with the products (_dot_sum)
    else:
        r3 = tl.arange(0, 4)[None, None, :]
        g = kb3 * 8 + 2 * r3 + HALF  # [1, KB, 4]
        if SPLIT:
            xw = x32 + kb * 64 + 16 * r + 8 * HALF + tl.arange(0, 4)[None, None, None, :]
            xa = tl.load(xw, mask=live, other=0)
            xb = tl.load(xw + 4, mask=live, other=0)
        else:
            xa = tl.load(x32 + kb * 64 + 16 * r + 8 * HALF + tl.arange(0, 8)[None, None, None, :], mask=live, other=0)
            xb = xa
        dx = tl.load(xd + g, mask=live3, other=0.0)
        sums = tl.load(xs + 2 * g) + tl.load(xs + 2 * g + 1)
    return xa, xb, dx, sums


@triton.jit
def _q4k_dot(wa, wb, w0, w1, w2, w3, xa_lo, xb_lo, dx_lo, s_lo, xa_hi, xb_hi, dx_hi, s_hi, ASM: tl.constexpr,
             ABL: tl.constexpr, SPLIT: tl.constexpr, QUANT_X: tl.constexpr):
    """``[BLOCK_N, KB, 4]`` float32: the words of :func:`_q4k_words` times the
    activations of :func:`_q4k_act` (``_lo``: sub-blocks ``2r``, ``_hi``: ``2r + 1``), run
    ``r`` of each block summed (with ``QUANT_X`` the codes' sums counted here)."""
    m4 = 0x0F0F0F0F
    if SPLIT:
        if ABL == 2:
            return tl.sum(wa + wb, axis=3).to(tl.float32)
        da, ca = _dot_sum(wa & m4, xa_lo, ASM, QUANT_X)
        db, cb = _dot_sum(wb & m4, xb_lo, ASM, QUANT_X)
        dot_lo = (da + db).to(tl.float32)
        if QUANT_X:
            s_lo = ca + cb
        da, ca = _dot_sum((wa >> 4) & m4, xa_hi, ASM, QUANT_X)
        db, cb = _dot_sum((wb >> 4) & m4, xb_hi, ASM, QUANT_X)
        dot_hi = (da + db).to(tl.float32)
        if QUANT_X:
            s_hi = ca + cb
    else:
        if ABL == 2:
            return tl.sum(wa, axis=3).to(tl.float32)
        da, ca = _dot_sum(wa & m4, xa_lo, ASM, QUANT_X)
        dot_lo = da.to(tl.float32)
        db, cb = _dot_sum((wa >> 4) & m4, xa_hi, ASM, QUANT_X)
        dot_hi = db.to(tl.float32)
        if QUANT_X:
            s_lo = ca
            s_hi = cb
    r3 = tl.arange(0, 4)[None, None, :]
    sc_lo, mn_lo = _k_scales_words(w1, w2, w3, 2 * r3)
    sc_hi, mn_hi = _k_scales_words(w1, w2, w3, 2 * r3 + 1)
    if ABL == 1:
        return dot_lo * dx_lo + dot_hi * dx_hi
    sum_lo = s_lo.to(tl.float32) * dx_lo
    sum_hi = s_hi.to(tl.float32) * dx_hi
    d = w0.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (w0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d * (dot_lo * sc_lo * dx_lo + dot_hi * sc_hi * dx_hi) - dmin * (mn_lo * sum_lo + mn_hi * sum_hi)


@triton.jit
def _q6k_words(w16, w32, w8, kb, kb3, NB, PLANES: tl.constexpr):
    """The weight words of Q6_K blocks ``kb`` of the rows at ``w16``/``w32``/``w8``
    (int16/int32/uint8 row pointers of rows of ``NB`` blocks), for index ``a`` = (half,
    word run) of each block: ``(lo_a, lo_b, qh, d)``, 16 of its words and its float32
    ``d``. ``PLANES``: the rows are in the ``Q6_K_P`` layout (:mod:`kernels.quant.repack`),
    read as whole words; GGUF's 210-byte blocks are read as 16-bit halves. Loads only,
    as :func:`_q4k_words`."""
    a = tl.arange(0, 4)[None, None, :, None]
    u = tl.arange(0, 4)[None, None, None, :]
    # ql word (h, l4 = 4q + u) at byte 64h + 4 l4 of the block's ql, qh's at 32h + 4 l4 of its qh.
    if PLANES:
        ql32 = w32 + kb * 32 + 16 * (a // 2) + 4 * (a % 2) + u
        lo_a = tl.load(ql32)
        lo_b = tl.load(ql32 + 8)
        qh = tl.load(w32 + NB * 32 + kb * 16 + 8 * (a // 2) + 4 * (a % 2) + u)
        d = _f16(w8 + NB * 208 + kb3 * 2)
    else:  # 105 halves a block
        base = w16 + kb * 105 + 2 * u
        ql = base + 32 * (a // 2) + 8 * (a % 2)
        lo_a = _word16(ql)
        lo_b = _word16(ql + 16)
        qh = _word16(base + 64 + 16 * (a // 2) + 8 * (a % 2))
        d = _f16(w8 + kb3 * 210 + 208)
    return lo_a, lo_b, qh, d


@triton.jit
def _q6k_act(x32, xd, xs, kb, kb3, live, live3, SUB: tl.constexpr, QUANT_X: tl.constexpr):
    """The activations :func:`_q6k_dot`'s ``d_SUB`` multiplies, for index ``a`` = (half
    ``h``, word run ``j``) of blocks ``kb``: ``(words, dx, sums)``, the codes of the 16
    elements from ``128h + 32 SUB + 16j`` as ``[1, KB, 4, 4]`` words, their group's scale
    and their sum (``[1, KB, 4]``). Read from the quantized row, or with ``QUANT_X``
    quantized here from the float row at ``x32`` (the sums then 0: the dot counts
    them); dead blocks give zeros (scale 0)."""
    if QUANT_X:
        a = tl.arange(0, 4)[None, None, :, None]
        e = ((kb * 256 + 128 * (a // 2) + 32 * SUB + 16 * (a % 2))[:, :, :, :, None]
             + 4 * tl.arange(0, 4)[None, None, None, :, None] + tl.arange(0, 4)[None, None, None, None, :])
        v, m16 = _x_load(x32, e, live)
        # A group of 32 is the runs a = 2h and 2h + 1 of a half: their larger magnitude,
        # for both (the compiled code is shorter than with the other run loaded again).
        kbs: tl.constexpr = m16.shape[1]
        pair = tl.max(tl.reshape(m16, (1, kbs, 2, 2)), axis=3)
        amax = tl.reshape(tl.join(pair, pair), (1, kbs, 4))
        words = _x_pack(v, amax)
        dx = _q8_scale(amax)
        sums = 0  # counted with the products (_dot_sum)
    else:
        a = tl.arange(0, 4)[None, None, :, None]
        u = tl.arange(0, 4)[None, None, None, :]
        words = tl.load(x32 + kb * 64 + 32 * (a // 2) + 4 * (a % 2) + u + 8 * SUB, mask=live, other=0)
        a3 = tl.arange(0, 4)[None, None, :]
        dx = tl.load(xd + kb3 * 8 + 4 * (a3 // 2) + SUB, mask=live3, other=0.0)
        sums = tl.load(xs + kb3 * 16 + 8 * (a3 // 2) + (a3 % 2) + 2 * SUB)
    return words, dx, sums


@triton.jit
def _q6k_dot(lo_a, lo_b, qh, d, w8, kb3, NB, x0, dx0, s0, x1, dx1, s1, x2, dx2, s2, x3, dx3, s3, ASM: tl.constexpr,
             ABL: tl.constexpr, PLANES: tl.constexpr, QUANT_X: tl.constexpr):
    """``[BLOCK_N, KB, 4]`` float32: the words of :func:`_q6k_words` times the activations
    of :func:`_q6k_act` (``x_i, dx_i, s_i`` for ``d_i``; with ``QUANT_X`` the sums counted
    here)."""
    if ABL == 2:
        return tl.sum(lo_a + lo_b + qh, axis=3).to(tl.float32)
    m4 = 0x0F0F0F0F
    m2 = 0x30303030
    d0, c0 = _dot_sum((lo_a & m4) | ((qh << 4) & m2), x0, ASM, QUANT_X)
    d1, c1 = _dot_sum((lo_b & m4) | ((qh << 2) & m2), x1, ASM, QUANT_X)
    d2, c2 = _dot_sum(((lo_a >> 4) & m4) | (qh & m2), x2, ASM, QUANT_X)
    d3, c3 = _dot_sum(((lo_b >> 4) & m4) | ((qh >> 2) & m2), x3, ASM, QUANT_X)
    if QUANT_X:
        s0, s1, s2, s3 = c0, c1, c2, c3
    if ABL == 1:
        return (d0 + d1 + d2 + d3).to(tl.float32)
    a3 = tl.arange(0, 4)[None, None, :]
    sc = w8 + NB * 192 + kb3 * 16 if PLANES else w8 + kb3 * 210 + 192  # the block's int8 scales
    sub = 8 * (a3 // 2) + (a3 % 2)  # sub-block of d0; d_i's is sub + 2i
    acc = _q6k_sub(d0, sc + sub, s0, dx0)
    acc += _q6k_sub(d1, sc + sub + 2, s1, dx1)
    acc += _q6k_sub(d2, sc + sub + 4, s2, dx2)
    acc += _q6k_sub(d3, sc + sub + 6, s3, dx3)
    return d * acc


@triton.jit
def _q6k_sub(dot, sc_ptr, sums, dx):
    """One Q6_K sub-block's ``sc * (dot - 32 * sum(codes)) * dx`` (zero point 32; ``sc_ptr``
    points at its int8 scale)."""
    sc = tl.load(sc_ptr).to(tl.int8, bitcast=True).to(tl.float32)
    return (dot - 32 * sums).to(tl.float32) * sc * dx


@triton.jit
def _step_blocks(kb0, step, step3, kb_end):
    """The blocks of the step from ``kb0``: ``(live, kb, live3, kb3)``, which of
    ``kb0 + step`` are before ``kb_end`` and the blocks themselves clamped to it (a dead
    block is read from the range's last one, in bounds), in the 4-D and 3-D tile shapes."""
    return kb0 + step < kb_end, tl.minimum(kb0 + step, kb_end - 1), kb0 + step3 < kb_end, tl.minimum(kb0 + step3, kb_end - 1)


@triton.jit
def _rows_dot(QT: tl.constexpr, w32_ptr, w16_ptr, w8_ptr, row0, N, K, row_bytes, row_words, row_halves, x32, xd, xs,
              kb_begin, kb_end, BLOCK_N: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr, ABL: tl.constexpr,
              SPLIT: tl.constexpr, PREFETCH: tl.constexpr, QUANT_X: tl.constexpr, PDL: tl.constexpr):
    """``[BLOCK_N]`` float32: weight rows ``row0 ...`` (of ``N``, type ``QT``) times the
    activation row at ``x32`` (with ``xd``, ``xs``) over blocks ``kb_begin`` to
    ``kb_end``; rows past ``N`` are read as row ``N - 1``. ``PDL``: the first step's
    weight words are loaded (with ``PREFETCH``) before the wait for the kernel that
    wrote the activations (:mod:`kernels.pdl`), and the next kernel may launch once
    the loop is done."""
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    w8 = w8_ptr + (rows * row_bytes)[:, None, None]  # [BLOCK_N, 1, 1]
    w32_3 = w32_ptr + (rows * row_words)[:, None, None]
    w32 = w32_3[:, :, :, None]
    w16 = w16_ptr + (rows * row_halves)[:, None, None, None]
    acc = tl.zeros([BLOCK_N, KB, 4], tl.float32)
    step = tl.arange(0, KB)[None, :, None, None]
    step3 = tl.arange(0, KB)[None, :, None]
    NB = K // 256
    # PREFETCH: the next step's weight words are loaded before this step's arithmetic,
    # so their latency overlaps it (Triton pipelines no loads in a loop without a dot).
    # Blocks past the range are read from its last block (in bounds) and multiplied
    # by zeroed activations and scales. Each step takes its activations before its
    # weight words (both modes): Triton lays a step out as the tile whose loads come
    # last (module docstring), the weights'.
    if QT == 5:
        na, nb, n0, n1, n2, n3 = _q4k_words(w32, w32_3, tl.minimum(kb_begin + step, kb_end - 1),
                                            tl.minimum(kb_begin + step3, kb_end - 1), SPLIT)
        pdl.wait(PDL)
        for kb0 in range(kb_begin, kb_end, KB):
            live, kb, live3, kb3 = _step_blocks(kb0, step, step3, kb_end)
            xa_lo, xb_lo, dx_lo, s_lo = _q4k_act(x32, xd, xs, kb, kb3, live, live3, 0, SPLIT, QUANT_X)
            xa_hi, xb_hi, dx_hi, s_hi = _q4k_act(x32, xd, xs, kb, kb3, live, live3, 1, SPLIT, QUANT_X)
            if PREFETCH:
                wa, wb, h0, h1, h2, h3 = na, nb, n0, n1, n2, n3
                na, nb, n0, n1, n2, n3 = _q4k_words(w32, w32_3, tl.minimum(kb0 + KB + step, kb_end - 1),
                                                    tl.minimum(kb0 + KB + step3, kb_end - 1), SPLIT)
            else:
                wa, wb, h0, h1, h2, h3 = _q4k_words(w32, w32_3, kb, kb3, SPLIT)
            acc += _q4k_dot(wa, wb, h0, h1, h2, h3, xa_lo, xb_lo, dx_lo, s_lo, xa_hi, xb_hi, dx_hi, s_hi, ASM, ABL,
                            SPLIT, QUANT_X)
    else:
        na, nb, nh, nd = _q6k_words(w16, w32, w8, tl.minimum(kb_begin + step, kb_end - 1),
                                    tl.minimum(kb_begin + step3, kb_end - 1), NB, QT == 8)
        pdl.wait(PDL)
        for kb0 in range(kb_begin, kb_end, KB):
            live, kb, live3, kb3 = _step_blocks(kb0, step, step3, kb_end)
            x0, dx0, s0 = _q6k_act(x32, xd, xs, kb, kb3, live, live3, 0, QUANT_X)
            x1, dx1, s1 = _q6k_act(x32, xd, xs, kb, kb3, live, live3, 1, QUANT_X)
            x2, dx2, s2 = _q6k_act(x32, xd, xs, kb, kb3, live, live3, 2, QUANT_X)
            x3, dx3, s3 = _q6k_act(x32, xd, xs, kb, kb3, live, live3, 3, QUANT_X)
            if PREFETCH:
                lo_a, lo_b, qh, d = na, nb, nh, nd
                na, nb, nh, nd = _q6k_words(w16, w32, w8, tl.minimum(kb0 + KB + step, kb_end - 1),
                                            tl.minimum(kb0 + KB + step3, kb_end - 1), NB, QT == 8)
            else:
                lo_a, lo_b, qh, d = _q6k_words(w16, w32, w8, kb, kb3, NB, QT == 8)
            acc += _q6k_dot(lo_a, lo_b, qh, d, w8, kb3, NB, x0, dx0, s0, x1, dx1, s1, x2, dx2, s2, x3, dx3, s3, ASM,
                            ABL, QT == 8, QUANT_X)
    pdl.launch_dependents(PDL)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _int8_gemv_kernel(
    xq_ptr, xd_ptr, xs_ptr, w32_ptr, w16_ptr, w8_ptr, out_ptr, M, N, K, row_bytes, row_words, row_halves,
    blocks_per_split, stride_xq, stride_xd, stride_xs, stride_om,
    w32b_ptr, w16b_ptr, w8b_ptr, N1, row_bytes1, row_words1, row_halves1,
    QT: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, ATOMIC: tl.constexpr, ASM: tl.constexpr,
    ABL: tl.constexpr = 0, SPLIT: tl.constexpr = 0, PREFETCH: tl.constexpr = 0, QUANT_X: tl.constexpr = 0,
    QT1: tl.constexpr = 0, PDL: tl.constexpr = 0,
):
    # ABL (timing only; wrong results): 1 leaves out the scales (the dot products times
    # the activation scales), 2 also the dot products (the weight words summed), so
    # differences of times place the kernel's time by stage (README).
    # QUANT_X: xq_ptr is the float activation row itself (stride_xq in elements; xd_ptr
    # and xs_ptr unused), quantized step by step in registers once for the BLOCK_N rows
    # (_q4k_act, _q6k_act): no launch and no round trip through memory for the codes.
    # QT1: a second part (type QT1, N1 rows at w32b_ptr/w16b_ptr/w8b_ptr) under the
    # first, written to output columns N ... N + N1 - 1 by the programs after the first
    # part's tiles; 0: one part (the second's arguments unused).
    # PDL: launched before the kernel that wrote the activations ends (kernels.pdl);
    # _rows_dot waits for it after loading its first weight words.
    # Grid as the float GEMV's: axis 0 = activation rows x weight tiles (the rows of
    # one tile launched together, so all but the first read it from L2), axis 1 = K ranges.
    pid_m = tl.program_id(0) % M
    pid_n = tl.program_id(0) // M
    pid_k = tl.program_id(1)
    x32 = xq_ptr + pid_m.to(tl.int64) * stride_xq  # int32 words of int8 codes, or (QUANT_X) floats
    xd = xd_ptr + pid_m.to(tl.int64) * stride_xd
    xs = xs_ptr + pid_m.to(tl.int64) * stride_xs
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, K // 256)
    if QT1 == 0:
        total = _rows_dot(QT, w32_ptr, w16_ptr, w8_ptr, pid_n * BLOCK_N, N, K, row_bytes, row_words, row_halves, x32,
                          xd, xs, kb_begin, kb_end, BLOCK_N, KB, ASM, ABL, SPLIT, PREFETCH, QUANT_X, PDL)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        end = N
    else:
        # A tile is one part's rows: the first part's last tile is partial, not shared.
        tiles0 = tl.cdiv(N, BLOCK_N)
        if pid_n < tiles0:
            total = _rows_dot(QT, w32_ptr, w16_ptr, w8_ptr, pid_n * BLOCK_N, N, K, row_bytes, row_words, row_halves,
                              x32, xd, xs, kb_begin, kb_end, BLOCK_N, KB, ASM, ABL, SPLIT, PREFETCH, QUANT_X, PDL)
        else:
            total = _rows_dot(QT1, w32b_ptr, w16b_ptr, w8b_ptr, (pid_n - tiles0) * BLOCK_N, N1, K, row_bytes1,
                              row_words1, row_halves1, x32, xd, xs, kb_begin, kb_end, BLOCK_N, KB, ASM, ABL, SPLIT,
                              PREFETCH, QUANT_X, PDL)
        second = pid_n >= tiles0
        cols = tl.where(second, N + (pid_n - tiles0) * BLOCK_N, pid_n * BLOCK_N) + tl.arange(0, BLOCK_N)
        end = tl.where(second, N + N1, N)
    out = out_ptr + pid_m * stride_om + cols
    if ATOMIC:
        tl.atomic_add(out, total, mask=cols < end)
    else:
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=cols < end)


def _configs() -> list[triton.Config]:
    """Tilings the tuned kernel picks from per (N, K, type): weight rows per program,
    blocks of K per step, warps, and for Q4_K whether a thread holds whole runs
    (``SPLIT``; then the tile's ``BLOCK_N * KB * 4`` runs at least fill the threads),
    each with and without the next step's words loaded ahead (``PREFETCH``). The plain
    ones were the best on the H200 for some 8B projection shape."""
    plain = [{"BLOCK_N": block_n, "KB": kb, "num_warps": warps}
             for block_n, kb, warps in ((8, 2, 4), (8, 4, 4), (4, 4, 2), (8, 8, 4), (32, 4, 8))]
    split = [{"BLOCK_N": block_n, "KB": kb, "SPLIT": 1, "num_warps": warps}
             for block_n, kb, warps in ((16, 4, 4), (32, 4, 8), (8, 2, 2))]
    # Few rows, many blocks a step: a small projection (q/k/v, o: one wave of programs,
    # latency-bound) issues all of a row's loads at once, as a 4096-wide row is 16 blocks.
    # With PREFETCH its one step's words are loaded before the loop, so under PDL
    # (kernels.pdl) before the wait for the kernel before it.
    wide = [{"BLOCK_N": block_n, "KB": kb, "num_warps": warps}
            for block_n, kb, warps in ((2, 16, 2), (4, 16, 4), (4, 8, 2), (1, 16, 2)) + _QUANT_X_TILINGS]
    return [triton.Config({k: v for k, v in c.items() if k != "num_warps"} | {"PREFETCH": prefetch},
                          num_warps=c["num_warps"])
            for c in plain + split + wide for prefetch in (0, 1)]


# (BLOCK_N, KB, warps) tried only when the kernel quantizes its rows (QUANT_X): every
# program quantizes the activations of its K range once a step, so more rows a program
# share that work, and a small projection's row is still one step or two.
_QUANT_X_TILINGS = ((8, 16, 4), (16, 8, 4))


def _prune(configs, named_args, **kwargs):
    """``SPLIT`` is Q4_K's alone (a part's); the :data:`_QUANT_X_TILINGS` are ``QUANT_X``'s."""
    quant_x = named_args.get("QUANT_X", kwargs.get("QUANT_X"))
    q4k = 5 in (named_args.get("QT", kwargs.get("QT")), named_args.get("QT1", kwargs.get("QT1")))
    return [c for c in configs if (q4k or not c.kwargs.get("SPLIT"))
            and (quant_x or (c.kwargs["BLOCK_N"], c.kwargs["KB"], c.num_warps) not in _QUANT_X_TILINGS)]


_tuned = triton.autotune(
    configs=_configs(), key=["N", "K", "QT", "QUANT_X", "N1", "QT1"], prune_configs_by={"early_config_prune": _prune},
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
)(_int8_gemv_kernel)


def int8_gemv(
    x: torch.Tensor | Q8Activations,
    blocks: torch.Tensor,
    type_name: str,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    blocks_per_step: int | None = None,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    variant: dict | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for ``x``'s activations rounded to int8 and ``W`` in Q4_K or Q6_K
    ``blocks`` (or Q6_K repacked as ``Q6_K_P``, :mod:`kernels.quant.repack`).

    Args:
        x: the float activations ``[M, K]`` (float32/bfloat16/float16, unit column
            stride), quantized inside the GEMV as :func:`quantize_activations` would
            (one launch; the same result bit for bit at the same tiling); or
            :func:`quantize_activations` of them, read as they are (a second launch,
            the codes shared by several calls).
        blocks: uint8 ``[N, K / 256 * block_bytes]``, GGUF blocks row by row.
        type_name: ``"Q4_K"``, ``"Q6_K"`` or ``"Q6_K_P"`` (then the rows are whole 32-bit
            words: an even number of blocks).
        block_n, split_k, blocks_per_step, num_warps: a forced tiling (tests, sweeps),
            as :func:`kernels.quant.triton_kernel.quant_gemv`'s; by default autotuned on
            CUDA when the rows fill the SMs twice over, else K is split.
        out: where to write ``[M, N]`` (``x``'s dtype, unit column stride), else a new tensor.
        variant: constexprs of a forced tiling: ``SPLIT`` (Q4_K: a thread holds whole
            runs), ``PREFETCH`` (the next step's weight words loaded ahead), ``ABL`` (timing a stage left out; the result is then wrong).

    Returns:
        ``[M, N]`` in ``x``'s dtype (float32 accumulation).

    Raises:
        ValueError: another type, blocks that do not hold rows of ``K`` weights, or float
            activations that are not 2-D with a unit column stride.
    """
    return int8_gemv_parts(x, [(blocks, type_name)], block_n=block_n, split_k=split_k,
                           blocks_per_step=blocks_per_step, num_warps=num_warps, out=out, variant=variant)


class _Part(NamedTuple):
    """One part's kernel arguments: its type's code, rows, the blocks as 32-bit words,
    16-bit halves and bytes, and its row stride in each."""

    code: int
    rows: int
    words: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, int, int]


def _part(blocks: torch.Tensor, type_name: str, k: int) -> _Part:
    if type_name not in INT8_TYPES:
        raise ValueError(f"the int8 GEMV reads {', '.join(INT8_TYPES)}, not {type_name}")
    fmt = block_format(type_name)
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != k // 256 * fmt.block_bytes \
            or k % 256 or blocks.stride(1) != 1 or blocks.stride(0) % (4 if fmt.code == 8 else 2):
        raise ValueError(f"{type_name} blocks {blocks.dtype} {tuple(blocks.shape)} do not hold rows of K={k} weights")
    # The same bytes seen as 32- and 16-bit words: aligned word loads (Q4_K's 144-byte
    # blocks) and Q6_K's halves; the bytes' own view reads the scales.
    flat = blocks.as_strided((blocks.stride(0) * (n - 1) + blocks.shape[1],), (1,))
    w32 = flat[: flat.numel() // 4 * 4].view(torch.int32)
    w16 = flat[: flat.numel() // 2 * 2].view(torch.int16)
    # Row strides in bytes, 32- and 16-bit words (Q6_K's word view is unused when the
    # rows are not whole words; Q6_K_P's rows always are).
    return _Part(fmt.code, n, (w32, w16, blocks), (blocks.stride(0), blocks.stride(0) // 4, blocks.stride(0) // 2))


def int8_gemv_parts(
    x: torch.Tensor | Q8Activations,
    parts: list[tuple[torch.Tensor, str]],
    *,
    block_n: int | None = None,
    split_k: int | None = None,
    blocks_per_step: int | None = None,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    variant: dict | None = None,
) -> torch.Tensor:
    """:func:`int8_gemv` of a weight stacked from one or two parts of (possibly)
    different types, in one launch: a fused projection whose shards differ in type (a
    Q4_K_M file's q/k in Q4_K over v in Q6_K). Each program's ``block_n`` rows are of one
    part; the first part's columns come first in the output.

    Args:
        x, block_n, split_k, blocks_per_step, num_warps, variant: as :func:`int8_gemv`'s
            (one tiling for both parts; ``SPLIT`` acts on a Q4_K part only).
        parts: ``[(blocks, type_name)]``, one or two, top to bottom, each as
            :func:`int8_gemv`'s ``blocks`` and ``type_name`` (the same ``K``).
        out: where to write ``[M, N0 + N1]`` (``x``'s dtype, unit column stride), else a
            new tensor.

    Returns:
        ``[M, N0 + N1]`` in ``x``'s dtype: each part's columns equal :func:`int8_gemv`
        of that part at the same tiling, bit for bit.

    Raises:
        ValueError: no part or more than two, or what :func:`int8_gemv` refuses.
    """
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"the int8 GEMV takes one or two parts in a launch, not {len(parts)}")
    quant_x = not isinstance(x, Q8Activations)
    if quant_x and (x.dim() != 2 or x.stride(1) != 1 or not x.dtype.is_floating_point):
        raise ValueError(f"want float activations [M, K] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape if quant_x else x.codes.shape
    first, *rest = [_part(blocks, type_name, k) for blocks, type_name in parts]
    # One part: the second's arguments are the first's, unused (QT1 = 0).
    second = rest[0] if rest else first._replace(code=0, rows=0)
    n = first.rows + second.rows
    nblocks = k // 256
    device = first.words[2].device
    result = _output(first.words[2].new_empty((m, 0), dtype=x.dtype), n, out)
    if quant_x:  # the scales' and sums' pointers are unused: x stands in for them
        acts = (x, x, x)
        strides = (x.stride(0), 0, 0)
    else:
        acts = (x.codes.view(torch.int32), x.scales, x.sums)
        strides = (x.codes.stride(0) // 4, x.scales.stride(0), x.sums.stride(0))

    def tiles(rows_per_program: int) -> int:
        return triton.cdiv(first.rows, rows_per_program) + triton.cdiv(second.rows, rows_per_program)

    def launch(kernel, grid, dest, per_split, **constexprs):
        kernel[grid](*acts, *first.words, dest, m, first.rows, k, *first.strides, per_split, *strides, dest.stride(0),
                     *second.words, second.rows, *second.strides, QT=first.code, QT1=second.code, QUANT_X=quant_x,
                     ASM=_ASM and device.type == "cuda", **pdl.launch_args(device), **constexprs)

    if (device.type == "cuda" and not _INTERPRETING and split_k is None and block_n is None
            and blocks_per_step is None and n >= 2 * _sm_count(device.index or 0)):
        launch(_tuned, lambda meta: (m * tiles(meta["BLOCK_N"]), 1), result, nblocks, ATOMIC=False)
        return result
    block_n = block_n or 4
    kb = blocks_per_step or 2
    if split_k is None:
        want = 4 * _sm_count(device.index or 0) if device.type == "cuda" else 1
        split_k = max(1, min(nblocks // kb or 1, -(-want // (m * tiles(block_n)))))
    per_split = triton.cdiv(nblocks, split_k)
    split = triton.cdiv(nblocks, per_split)
    atomic = split > 1
    dest = torch.zeros((m, n), device=device, dtype=torch.float32) if atomic else result
    launch(_int8_gemv_kernel, (m * tiles(block_n), split), dest, per_split, BLOCK_N=block_n, KB=kb, ATOMIC=atomic,
           num_warps=num_warps, **(variant or {}))
    if atomic:
        result.copy_(dest)
    return result
