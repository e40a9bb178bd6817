"""Projections of a decode step: references for :mod:`kernels.gemv.triton_kernel`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias).

    Args:
        x: ``[T, K]``.
        weight: ``[N, K]``, same dtype.

    Returns:
        ``[T, N]`` in ``x``'s dtype.
    """
    return F.linear(x, weight)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's fused gate/up projection followed by SiLU-and-mul:
    ``silu(x @ W_gate.T) * (x @ W_up.T)``.

    Args:
        x: ``[T, H]``.
        weight: ``[2 * I, H]``, the gate rows first, then the up rows.

    Returns:
        ``[T, I]`` in ``x``'s dtype.
    """
    return silu_and_mul(F.linear(x, weight))
