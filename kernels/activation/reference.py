"""Gated activations of the MLP."""

from __future__ import annotations

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
