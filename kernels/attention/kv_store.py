"""KV cache storage dtypes: writing keys/values into a pool buffer and reading them back.

A pool buffer is either in the model's dtype or in ``float8_e4m3fn``
(``--kv-cache-dtype fp8``). FP8 pages hold the values themselves, with a per-tensor
scale of 1.0 (vLLM's default for an FP8 KV cache without calibrated scales): keys and
values of the supported models sit well inside e4m3's range (+-448), so a value is
clamped to that range and rounded to nearest-even; reading upcasts. Torch on the CPU
has ``float8_e4m3fn`` tensors and casts, but no ``index_copy_``/``index_select`` for
them, so the scatter and gather run on a ``uint8`` view of the same bytes (one byte per
element either way, on every device).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
# Largest finite float8_e4m3fn value (OCP FP8 spec; torch.finfo(torch.float8_e4m3fn).max).
FP8_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's storage ``dtype``; FP8 clamps to +-448 first (a plain cast
    makes an out-of-range value NaN)."""
    if is_fp8(dtype):
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def scatter_kv(buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``buf[slots[i]] = x[i]`` in ``buf``'s dtype.

    Args:
        buf: ``[num_slots, H_kv, D]`` one layer's key or value buffer.
        slots: ``[T]`` int64.
        x: ``[T, H_kv, D]`` in any float dtype.
    """
    # index_copy_ is a plain scatter; advanced-index assignment goes through the
    # slower index_put_ machinery.
    if is_fp8(buf.dtype):
        buf.view(torch.uint8).index_copy_(0, slots, to_kv_dtype(x, buf.dtype).view(torch.uint8))
    else:
        buf.index_copy_(0, slots, x.to(buf.dtype))


def gather_kv(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf[slots]`` upcast to ``dtype``: ``[len(slots), H_kv, D]``."""
    if is_fp8(buf.dtype):
        return buf.view(torch.uint8).index_select(0, slots).view(buf.dtype).to(dtype)
    return buf.index_select(0, slots).to(dtype)
