"""Float weights to Q4_K and Q6_K blocks, for tests and benchmarks that need K-quant
files of real (trained) weights: ``gguf`` dequantizes K-quants but has no quantizer.

The encoders round to nearest on plain scales, no search for the best scale as
llama.cpp's ``make_qkx2_quants`` does, so their error is somewhat larger than
llama-quantize's, never smaller. The layouts are ggml's (``ggml-common.h``,
``block_q4_K`` and ``block_q6_K``); :func:`kernels.quant.reference.dequantize` (gguf's
dequantizers) reads them back.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _superblocks(w: np.ndarray) -> np.ndarray:
    """``w`` ``[rows, cols]`` as float32 ``[rows * cols / 256, 256]``; ``cols`` must be
    whole blocks of 256."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"K-quant rows are whole blocks of {QK_K} values; got shape {w.shape}")
    return w.reshape(-1, QK_K)


def _code_scales(scales: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales ``[n, s]`` (non-negative) as a float16 super-scale ``[n]`` and
    integer codes ``0..top`` with ``super * code ~ scale``."""
    d = (scales.max(axis=1) / top).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    codes = np.clip(np.rint(np.divide(scales, df, out=np.zeros_like(scales), where=df > 0)), 0, top)
    return d, codes.astype(np.int32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` float ``[rows, cols]`` (``cols`` a multiple of 256) as Q4_K blocks: uint8
    ``[rows, cols / 256 * 144]``. Each sub-block of 32 is ``d * sc * q - dmin * m`` with
    ``q`` in 0..15 and 6-bit ``sc``, ``m``.

    Raises:
        ValueError: ``w`` is not 2-D or its rows are not whole blocks of 256.
    """
    rows = np.asarray(w).shape[0]
    x = _superblocks(w).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)
    d, sc = _code_scales((x.max(axis=2) - lo) / 15.0, 63)
    dmin, m = _code_scales(-lo, 63)
    step = d.astype(np.float32)[:, None] * sc
    shift = dmin.astype(np.float32)[:, None] * m
    q = np.divide(x + shift[..., None], step[..., None], out=np.zeros_like(x), where=step[..., None] > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)
    n = x.shape[0]
    out = np.zeros((n, 144), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    scales = out[:, 4:16]  # get_scale_min_k4's packing of 8 six-bit scales and mins
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # each 64 values: the first 32 in low nibbles, the next in high
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``w`` float ``[rows, cols]`` (``cols`` a multiple of 256) as Q6_K blocks: uint8
    ``[rows, cols / 256 * 210]``. Each sub-block of 16 is ``d * sc * q`` with ``q`` in
    -32..31 and an int8 ``sc``.

    Raises:
        ValueError: ``w`` is not 2-D or its rows are not whole blocks of 256.
    """
    rows = np.asarray(w).shape[0]
    x = _superblocks(w).reshape(-1, 16, 16)
    d, sc = _code_scales(np.abs(x).max(axis=2) / 31.0, 127)
    step = d.astype(np.float32)[:, None] * sc
    q = np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, quarter, 32]
    n = x.shape[0]
    out = np.zeros((n, 210), dtype=np.uint8)
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out[:, 0:128] = ql.reshape(n, 128)
    out[:, 128:192] = qh.reshape(n, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    return out.reshape(rows, -1)


ENCODERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
