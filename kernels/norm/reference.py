"""RMSNorm (Zhang & Sennrich, 2019), as Llama/Qwen compute it in transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension.

    Args:
        x: ``[T, H]`` (any leading dimensions work) in float32, bfloat16 or float16.
        weight: ``[H]``, same dtype as ``x``.
        eps: added to the mean square before the square root.

    Returns:
        ``[T, H]`` in ``x``'s dtype. The statistics are computed in float32 and the
        normalized value is cast back to ``x``'s dtype *before* the multiply by ``weight``,
        exactly like transformers' ``LlamaRMSNorm``, so low-precision outputs match
        bit for bit.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same arithmetic in one op (no casts to round in float32): on the CPU, where
        # a decode step is hundreds of small ops, one instead of six.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a sublayer's output to the residual stream, then RMSNorm the sum.

    ``residual += x`` in ``x``'s dtype (the ``hidden = residual + hidden`` of
    transformers' decoder layer, one rounding), then ``rms_norm(residual)``.

    Args:
        x: ``[T, H]``, the sublayer output; not modified.
        residual: ``[T, H]``, same dtype; updated in place (one less ``[T, H]``
            allocation per sublayer).
        weight: ``[H]``; eps: as in :func:`rms_norm`.

    Returns:
        ``(normed, residual)``: a new ``[T, H]`` tensor and ``residual`` itself.
    """
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual
