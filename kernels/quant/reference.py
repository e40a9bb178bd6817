"""Plain-torch reference of the quantized matmul, built on ``gguf``'s dequantizers.

Slow (the blocks travel to the host and back through NumPy on every call): the kernels'
yardstick in tests, and the path a quantized linear takes off CUDA.
"""

from __future__ import annotations

import gguf.quants
import numpy as np
import torch

from kernels.quant.formats import block_format
from kernels.quant.repack import to_gguf_blocks


def dequantize(blocks: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """The float32 weight ``[N, in_features]`` of ``blocks``.

    Args:
        blocks: ``[N, in_features / block_elements * block_bytes]`` uint8, the GGUF
            tensor's bytes (any device).
        type_name: its GGML type name (see :data:`kernels.quant.formats.FORMATS`), or a
            repacked layout (:data:`kernels.quant.formats.REPACKED`).
        in_features: ``K``, a multiple of the block's element count.

    Returns:
        float32 ``[N, in_features]`` on ``blocks``' device.
    """
    fmt = block_format(type_name)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"blocks must be a 2-D uint8 tensor, got {blocks.dtype} {tuple(blocks.shape)}")
    if in_features % fmt.block_elements or blocks.shape[1] != in_features // fmt.block_elements * fmt.block_bytes:
        raise ValueError(f"{type_name} blocks of shape {tuple(blocks.shape)} do not hold rows of {in_features} weights")
    blocks, _ = to_gguf_blocks(blocks, type_name)
    raw = np.ascontiguousarray(blocks.cpu().numpy())
    w = gguf.quants.dequantize(raw, fmt.qtype).reshape(blocks.shape[0], in_features)
    return torch.from_numpy(np.asarray(w, dtype=np.float32)).to(blocks.device)


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """``x @ W.T`` for the quantized ``W`` in ``blocks``.

    Args:
        x: ``[M, K]`` activations (float32, bfloat16 or float16).
        blocks: ``[N, K / block_elements * block_bytes]`` uint8.
        type_name: the GGML type of ``blocks``.

    Returns:
        ``[M, N]`` in ``x.dtype``, accumulated in float32.
    """
    w = dequantize(blocks, type_name, x.shape[-1])
    return (x.float() @ w.T).to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as the int8 GEMV takes it (``K % 32 == 0``): per group of 32 values,
    ``scale = amax / 127`` and codes ``round(x * (127 / amax))`` half away from zero
    (llama.cpp's ``quantize_q8_1``, with the reciprocal multiplied as the kernel does).

    Returns:
        ``(codes int8 [M, K], scales float32 [M, K / 32], sums int32 [M, K / 16])``, the
        sums being the codes' per 16 values; a group of zeros has scale 0 and codes 0.
    """
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    amax = g.abs().amax(dim=2)
    # Tensor by tensor: torch divides by a Python scalar through its reciprocal on CUDA,
    # one rounding more than the kernel's correctly rounded division.
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, c127 / amax.clamp_min(1e-30), torch.zeros_like(amax))
    v = g * inv[..., None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v)).to(torch.int32)
    sums = q.reshape(m, k // 16, 16).sum(dim=2, dtype=torch.int32)
    return q.reshape(m, k).to(torch.int8), amax / c127, sums


def quant_matmul_int8(x: torch.Tensor, blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """``x @ W.T`` as the int8 GEMV computes it: ``x`` rounded by
    :func:`quantize_activations`, then multiplied in float32 by the exact ``W``.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    codes, scales, _ = quantize_activations(x)
    xq = (codes.float().reshape(x.shape[0], -1, 32) * scales[..., None]).reshape(x.shape)
    w = dequantize(blocks, type_name, x.shape[-1])
    return (xq @ w.T).to(x.dtype)
