"""Triton q/k norm + rotary + KV-cache store; reference :func:`kernels.rotary.reference.rotary_and_store`.

One program per token does the whole attention input of that token: all query heads,
all key heads and the values, as ``[heads, D/2]`` tiles (the two halves of each head are
the rotated pairs of the "rotate_half" layout). It reads ``q``/``k``/``v`` through their
strides, so the views of the fused q/k/v projection go in without a copy, and writes
rotated ``k`` and ``v`` straight into the layer's pool buffers at the token's slot.

Rounding follows the reference for low-precision inputs: ``cos``/``sin`` are cast to
the input dtype, and each product and each sum is rounded to it, as the eager torch ops
do one at a time.

A pool of llama.cpp's blocks (``--kv-cache-dtype q8_0``/``q4_0``) takes the step's rows
through the same launch into a scratch ``[T, Hk, D]`` of the model's dtype, then the
quantizing store of :mod:`kernels.attention.triton_kv_store` (one launch for the keys,
one for the values; a decode step is still captured in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention import triton_kv_store
from kernels.attention.kv_store import FP8_MAX, block_format, is_fp8
from kernels.triton_round import round_to


@triton.jit
def _norm_rotate(src, m, w_ptr, dt_ptr, cols, col_mask, cos, sin, eps, D,
                 HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """Load the ``[heads, HALF]`` halves at ``src`` / ``src + HALF`` and rotate them;
    rounds like the eager ops to ``dt_ptr``'s dtype."""
    dt = dt_ptr.dtype.element_ty
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
        rstd = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        x1 = round_to(round_to(x1 * rstd, dt) * w1, dt)
        x2 = round_to(round_to(x2 * rstd, dt) * w2, dt)
    a = round_to(x1 * cos, dt)
    b = round_to(x2 * sin, dt)
    c = round_to(x2 * cos, dt)
    d = round_to(x1 * sin, dt)
    return round_to(a - b, dt).to(dt), round_to(c + d, dt).to(dt)


@triton.jit
def _to_cache(x, cache_ptr, FP8_MAX: tl.constexpr):
    """``x`` in the pool's dtype; an FP8 pool (``FP8_MAX > 0``) clamps first, as
    :func:`kernels.attention.kv_store.to_kv_dtype` does."""
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
    qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    HQ, HK, D, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
    HQ_BLOCK: tl.constexpr, HK_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = 0,
):
    # PDL (kernels.pdl): launched while the q/k/v projection ends.
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, HALF_BLOCK)
    col_mask = cols < HALF
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=col_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + cols, mask=col_mask, other=0.0)
    cos = round_to(cos, dt)[None, :]
    sin = round_to(sin, dt)[None, :]

    # Queries -> a fresh contiguous [T, HQ, D].
    hq = tl.arange(0, HQ_BLOCK)
    m = (hq < HQ)[:, None] & col_mask[None, :]
    src = q_ptr + t * stride_qt + hq[:, None] * stride_qh + cols[None, :]
    o1, o2 = _norm_rotate(src, m, qw_ptr, q_out_ptr, cols, col_mask, cos, sin, eps, D, HAS_NORM, HALF)
    dst = q_out_ptr + t * HQ * D + hq[:, None] * D + cols[None, :]
    tl.store(dst, o1, mask=m)
    tl.store(dst + HALF, o2, mask=m)

    # Keys (rotated) and values -> the pool at this token's slot.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hk = tl.arange(0, HK_BLOCK)
    m = (hk < HK)[:, None] & col_mask[None, :]
    src = k_ptr + t * stride_kt + hk[:, None] * stride_kh + cols[None, :]
    o1, o2 = _norm_rotate(src, m, kw_ptr, q_out_ptr, cols, col_mask, cos, sin, eps, D, HAS_NORM, HALF)
    dst = slot * HK * D + hk[:, None] * D + cols[None, :]
    tl.store(k_cache_ptr + dst, _to_cache(o1, k_cache_ptr, FP8_MAX), mask=m)
    tl.store(k_cache_ptr + dst + HALF, _to_cache(o2, k_cache_ptr, FP8_MAX), mask=m)
    src = v_ptr + t * stride_vt + hk[:, None] * stride_vh + cols[None, :]
    tl.store(v_cache_ptr + dst, _to_cache(tl.load(src, mask=m, other=0.0), v_cache_ptr, FP8_MAX), mask=m)
    tl.store(v_cache_ptr + dst + HALF, _to_cache(tl.load(src + HALF, mask=m, other=0.0), v_cache_ptr, FP8_MAX),
             mask=m)


def rotary_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Same contract as :func:`kernels.rotary.reference.rotary_and_store`, one launch.

    Raises:
        ValueError: an odd head dim, a last dimension that is not contiguous, or pool
            buffers that are not contiguous ``[num_slots, Hk, D]``.
    """
    T, HQ, D = q.shape
    HK = k.shape[1]
    if block_format(k_cache.dtype) is not None:
        rows = [torch.empty((T, HK, D), dtype=q.dtype, device=q.device) for _ in range(2)]
        q_out = rotary_and_store(q, k, v, positions, cos_sin_cache, *rows, torch.arange(T, device=q.device),
                                 q_norm_weight, k_norm_weight, norm_eps)
        triton_kv_store.scatter_kv(k_cache, out_slots, rows[0])
        triton_kv_store.scatter_kv(v_cache, out_slots, rows[1])
        return q_out
    if D % 2:
        raise ValueError(f"rotary needs an even head dim, got {D}")
    if any(x.stride(-1) != 1 for x in (q, k, v)) or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k, v and the cos/sin cache need a contiguous last dimension")
    for buf in (k_cache, v_cache):
        if not buf.is_contiguous() or tuple(buf.shape[1:]) != (HK, D):
            raise ValueError(
                f"pool buffers must be contiguous [num_slots, {HK}, {D}], got shape "
                f"{tuple(buf.shape)}"
            )
    q_out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    has_norm = q_norm_weight is not None
    half = D // 2
    tile = max(HQ, HK) * half
    _rotary_store_kernel[(T,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_slots, q_out,
        q_norm_weight if has_norm else q_out, k_norm_weight if has_norm else q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        HQ, HK, D, norm_eps,
        HAS_NORM=has_norm, HALF=half, HALF_BLOCK=triton.next_power_of_2(half),
        HQ_BLOCK=triton.next_power_of_2(HQ), HK_BLOCK=triton.next_power_of_2(HK),
        FP8_MAX=FP8_MAX if is_fp8(k_cache.dtype) else 0.0,
        num_warps=4 if tile <= 4096 else 8, **pdl.launch_args(q.device),
    )
    return q_out
