"""Gated activations of the MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer, 2020): ``silu(gate) * up`` with ``x = [gate | up]``.

    Args:
        x: ``[T, 2 * I]``, the output of the fused gate/up projection, gate half first.

    Returns:
        ``[T, I]`` in ``x``'s dtype.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation (``GptOssExperts._apply_gate`` in transformers):
    the gate clamped above at ``limit``, the up half at ``±limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Called on ``[T, 2 * I]`` gate/up rows,
    gate half first (as :func:`silu_and_mul`), it returns ``[T, I]`` in their dtype."""

    alpha: float
    limit: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
