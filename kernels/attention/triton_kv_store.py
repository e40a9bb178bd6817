"""Triton store into a pool of llama.cpp's blocks; reference
:func:`kernels.attention.kv_store.scatter_kv` (the same bytes).

One program per token writes all of its KV heads: each head's row of ``D`` values is
``D / 32`` blocks, loaded as their first and second sixteen values (q4_0 packs value
``j`` and ``16 + j`` into one byte), each block's scale found from its largest magnitude
and its codes rounded as llama.cpp's reference quantizer does. The scale's float16 bits
go in as two bytes (little-endian). Divisions are IEEE (``div_rn``) and the launch
contracts no product and sum into an FMA, so the codes are the torch store's bit for
bit (``tests/test_block_kv.py`` compares them in Triton's interpreter).

Where it runs: after the fused rotary launch, which rotates a block pool's keys into a
scratch of the model's dtype (:mod:`kernels.rotary.triton_kernel`); two launches a layer
(keys, values) where the torch store is some twenty small ones each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_formats import KV_BLOCK, KV_BLOCK_BYTES
from kernels.attention.kv_store import block_format

_FMT = {"q8_0": 1, "q4_0": 2}


@triton.jit
def _store_blocks_kernel(X, Slots, Buf, stride_xt, stride_xh, stride_bs, stride_bh, HK,
                         HK_BLOCK: tl.constexpr, NB: tl.constexpr, NB_BLOCK: tl.constexpr,
                         BLOCK_BYTES: tl.constexpr, FMT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, HK_BLOCK)[:, None, None]
    b = tl.arange(0, NB_BLOCK)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    m = (h < HK) & (b < NB) & (j < 16)  # [HK, NB, 16]
    src = X + t * stride_xt + h * stride_xh + b * 32 + j
    lo = tl.load(src, mask=m, other=0.0).to(tl.float32)  # values j of each block
    hi = tl.load(src + 16, mask=m, other=0.0).to(tl.float32)  # values 16 + j
    amax_lo = tl.max(tl.abs(lo), 2)
    amax_hi = tl.max(tl.abs(hi), 2)
    if FMT == 1:
        d = tl.div_rn(tl.maximum(amax_lo, amax_hi), tl.full(amax_lo.shape, 127.0, tl.float32))
    else:
        # The value of the largest magnitude, its first place in the block on a tie.
        first_lo = tl.argmax(tl.abs(lo), 2, tie_break_left=True)
        first_hi = tl.argmax(tl.abs(hi), 2, tie_break_left=True)
        m_lo = tl.sum(tl.where(j == first_lo[:, :, None], lo, 0.0), 2)
        m_hi = tl.sum(tl.where(j == first_hi[:, :, None], hi, 0.0), 2)
        d = tl.div_rn(tl.where(amax_lo >= amax_hi, m_lo, m_hi), tl.full(amax_lo.shape, -8.0, tl.float32))
    inv = tl.where(d == 0.0, 0.0, tl.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d == 0.0, 1.0, d)))
    dst = Buf + slot * stride_bs + h * stride_bh + b * BLOCK_BYTES  # [HK, NB, 1]: each block's first byte
    # The scale's float16 bits as one 16-bit store a block (blocks start at even bytes).
    # Two byte stores masked to the first of the 16 lanes (j == 0) wrote 0 for the low
    # byte of every block's scale when compiled for an H200 at 8 heads of 128 (not at 3
    # of 64, nor in the interpreter): the scale off by up to a quarter.
    bits = d.to(tl.float16).to(tl.uint16, bitcast=True)[:, :, None]
    tl.store(dst.to(tl.pointer_type(tl.uint16)), bits, mask=(h < HK) & (b < NB))
    x_lo = lo * inv[:, :, None]
    x_hi = hi * inv[:, :, None]
    if FMT == 1:
        # roundf, half away from zero, as the torch store writes it.
        a_lo, a_hi = tl.abs(x_lo), tl.abs(x_hi)
        r_lo = tl.floor(a_lo) + tl.floor(2.0 * (a_lo - tl.floor(a_lo)))
        r_hi = tl.floor(a_hi) + tl.floor(2.0 * (a_hi - tl.floor(a_hi)))
        tl.store(dst + 2 + j, tl.where(x_lo < 0, -r_lo, r_lo).to(tl.int8), mask=m)
        tl.store(dst + 18 + j, tl.where(x_hi < 0, -r_hi, r_hi).to(tl.int8), mask=m)
    else:
        q_lo = tl.minimum(tl.maximum(tl.floor(x_lo + 8.5), 0.0), 15.0).to(tl.uint8)
        q_hi = tl.minimum(tl.maximum(tl.floor(x_hi + 8.5), 0.0), 15.0).to(tl.uint8)
        tl.store(dst + 2 + j, q_lo | (q_hi << 4), mask=m)


def scatter_kv(buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """:func:`kernels.attention.kv_store.scatter_kv` into a block pool, one launch.

    Args:
        buf: ``[num_slots, H_kv, D / 32 * block_bytes]`` a q8_0 (int8) or q4_0 (uint8)
            buffer, contiguous in its last two dimensions.
        slots: ``[T]`` int64, distinct.
        x: ``[T, H_kv, D]`` in any float dtype, last dimension contiguous.

    Raises:
        ValueError: ``buf`` is not a block pool, or the shapes do not match.
    """
    fmt = block_format(buf.dtype)
    t, hk, d = x.shape
    if fmt is None or d % KV_BLOCK or buf.shape[1:] != (hk, d // KV_BLOCK * KV_BLOCK_BYTES[fmt]):
        raise ValueError(f"a block pool [slots, {hk}, {d} / 32 x block bytes] wanted, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    if x.stride(-1) != 1 or buf.stride(-1) != 1:
        raise ValueError("x and the pool need a contiguous last dimension")
    if buf.data_ptr() % 2 or buf.stride(0) % 2 or buf.stride(1) % 2:
        raise ValueError("the pool's blocks must start at even bytes (a scale is one 16-bit store)")
    if t == 0:
        return
    nb = d // KV_BLOCK
    _store_blocks_kernel[(t,)](
        x, slots, buf, x.stride(0), x.stride(1), buf.stride(0), buf.stride(1), hk,
        HK_BLOCK=triton.next_power_of_2(hk), NB=nb, NB_BLOCK=triton.next_power_of_2(nb),
        BLOCK_BYTES=KV_BLOCK_BYTES[fmt], FMT=_FMT[fmt], enable_fp_fusion=False,
    )
