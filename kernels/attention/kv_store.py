"""KV cache storage dtypes: writing keys/values into a pool buffer and reading them back.

A pool buffer is in the model's dtype, in ``float8_e4m3fn`` (``--kv-cache-dtype fp8``),
or in llama.cpp's blocks (``q8_0``, ``q4_0``; :mod:`kernels.attention.kv_formats`).

FP8 pages hold the values themselves, with a per-tensor scale of 1.0 (vLLM's default
for an FP8 KV cache without calibrated scales): keys and values of the supported models
sit well inside e4m3's range (+-448), so a value is clamped to that range and rounded to
nearest-even; reading upcasts. Torch on the CPU has ``float8_e4m3fn`` tensors and casts,
but no ``index_copy_``/``index_select`` for them, so the scatter and gather run on a
``uint8`` view of the same bytes (one byte per element either way, on every device).

Block pages: a buffer is ``[num_slots, H_kv, head_dim / 32 * block_bytes]`` bytes, each
head's row its ``head_dim / 32`` blocks as llama.cpp lays them out (the float16 scale,
then the codes), so a slot is still one row and the pool's copies, resizes and releases
work on rows as for any dtype. The buffer's dtype names the format: ``int8`` for q8_0,
``uint8`` for q4_0 (no model runs in either). The store quantizes the new rows (as
llama.cpp's reference quantizer does, byte for byte: float32 arithmetic, q8_0 rounding
half away from zero); the gather dequantizes only the rows it reads.
"""

from __future__ import annotations

import torch

from kernels.attention.kv_formats import KV_BLOCK, KV_BLOCK_BYTES, kv_values_bytes

FP8_KV_DTYPE = torch.float8_e4m3fn
# Largest finite float8_e4m3fn value (OCP FP8 spec; torch.finfo(torch.float8_e4m3fn).max).
FP8_MAX = 448.0
# The storage dtype that stands for each block format.
BLOCK_KV_DTYPES: dict[str, torch.dtype] = {"q8_0": torch.int8, "q4_0": torch.uint8}
_FORMAT_OF = {dtype: name for name, dtype in BLOCK_KV_DTYPES.items()}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def block_format(dtype: torch.dtype) -> str | None:
    """``"q8_0"`` or ``"q4_0"`` for a block pool's storage dtype, else None."""
    return _FORMAT_OF.get(dtype)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The name the plan and the engine's info give a storage dtype: ``q8_0``, ``q4_0``,
    or torch's name without its prefix (``bfloat16``, ``float8_e4m3fn``)."""
    return block_format(dtype) or str(dtype).removeprefix("torch.")


def kv_row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of a pool buffer's last dimension: one head's row of ``head_dim`` values
    (for a block pool, its bytes)."""
    fmt = block_format(dtype)
    return head_dim if fmt is None else kv_values_bytes(fmt, head_dim, 1)


def kv_bytes(dtype: torch.dtype, values: int) -> int:
    """Bytes that ``values`` keys or values take in a pool of storage ``dtype``.

    Raises:
        ValueError: a block pool and ``values`` not a multiple of 32.
    """
    fmt = block_format(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return kv_values_bytes(fmt or "auto", values, itemsize)


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's storage ``dtype``; FP8 clamps to +-448 first (a plain cast
    makes an out-of-range value NaN), a block format quantizes the last dimension
    (:func:`quantize_blocks`)."""
    fmt = block_format(dtype)
    if fmt is not None:
        return quantize_blocks(x, fmt)
    if is_fp8(dtype):
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def quantize_blocks(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [..., D]`` (``D % 32 == 0``, any float dtype) as llama.cpp's blocks of
    ``fmt``: ``[..., D / 32 * block_bytes]`` in the format's storage dtype."""
    blocks = x.float().reshape(*x.shape[:-1], -1, KV_BLOCK)  # [..., nb, 32]
    if fmt == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = blocks * torch.where(d == 0, 0.0, 1.0 / d)
        a = q.abs()
        # roundf, half away from zero; floor(a + 0.5) would round 0.5 - 2**-25 up.
        q = q.sign() * (a.floor() + (2 * (a - a.floor())).floor())
        codes = q.to(torch.int8).view(torch.uint8)
    else:  # q4_0
        m = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # the value of the largest magnitude
        d = m / -8
        q = (blocks * torch.where(d == 0, 0.0, 1.0 / d) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        codes = q[..., : KV_BLOCK // 2] | (q[..., KV_BLOCK // 2 :] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # [..., nb, 2], little-endian as llama.cpp writes it
    out = torch.cat((scale, codes), -1).reshape(*x.shape[:-1], -1)
    return out.view(BLOCK_KV_DTYPES[fmt])


def dequantize_blocks(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows [..., D / 32 * block_bytes]`` of a block pool (its storage dtype) as
    ``[..., D]`` values in ``dtype`` (each ``code * scale`` in float32, then cast)."""
    fmt = block_format(rows.dtype)
    raw = rows.view(torch.uint8).reshape(*rows.shape[:-1], -1, KV_BLOCK_BYTES[fmt])  # [..., nb, bytes]
    scale = raw[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    if fmt == "q8_0":
        codes = raw[..., 2:].view(torch.int8).float()
    else:
        nibbles = raw[..., 2:]
        codes = torch.cat((nibbles & 15, nibbles >> 4), -1).float() - 8
    return (codes * scale).reshape(*rows.shape[:-1], -1).to(dtype)


def scatter_kv(buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``buf[slots[i]] = x[i]`` in ``buf``'s dtype (quantized for a block pool).

    Args:
        buf: ``[num_slots, H_kv, W]`` one layer's key or value buffer
            (``W``: :func:`kv_row_width`).
        slots: ``[T]`` int64.
        x: ``[T, H_kv, D]`` in any float dtype.
    """
    # index_copy_ is a plain scatter; advanced-index assignment goes through the
    # slower index_put_ machinery.
    if is_fp8(buf.dtype):
        buf.view(torch.uint8).index_copy_(0, slots, to_kv_dtype(x, buf.dtype).view(torch.uint8))
    else:
        buf.index_copy_(0, slots, to_kv_dtype(x, buf.dtype))


def gather_kv(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf[slots]`` upcast (or dequantized) to ``dtype``: ``[len(slots), ..., D]``;
    ``buf`` is ``[rows, ..., W]``, a layer's buffer or a view of it as head rows."""
    if is_fp8(buf.dtype):
        return buf.view(torch.uint8).index_select(0, slots).view(buf.dtype).to(dtype)
    if block_format(buf.dtype) is not None:
        return dequantize_blocks(buf.index_select(0, slots), dtype)
    return buf.index_select(0, slots).to(dtype)
