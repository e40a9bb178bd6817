"""The int8 GEMV's step, in Triton: the weight words of Q4_K and Q6_K blocks (GGUF's or
Q6_K repacked into planes), the activations' code words, their ``dp4a`` dot products
and the K loop over a tile of weight rows, :func:`rows_dot`, that
:mod:`kernels.quant.triton_int8`'s kernel runs once a program. The layouts and the
arithmetic are described there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.triton_activations import q8_inv, q8_round, q8_scale
from kernels.quant.triton_decode import f16


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
    q = q8_round(v * q8_inv(amax)[:, :, :, None, None])
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
        dx = q8_scale(amax)
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
        d = f16(w8 + NB * 208 + kb3 * 2)
    else:  # 105 halves a block
        base = w16 + kb * 105 + 2 * u
        ql = base + 32 * (a // 2) + 8 * (a % 2)
        lo_a = _word16(ql)
        lo_b = _word16(ql + 16)
        qh = _word16(base + 64 + 16 * (a // 2) + 8 * (a % 2))
        d = f16(w8 + kb3 * 210 + 208)
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
        dx = q8_scale(amax)
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
def rows_dot(QT: tl.constexpr, w32_ptr, w16_ptr, w8_ptr, row0, N, K, row_bytes, row_words, row_halves, x32, xd, xs,
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
