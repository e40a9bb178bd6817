"""Triton RMSNorm and residual-add + RMSNorm; references in :mod:`kernels.rms_norm`.

One program per row, the whole row in registers (hidden sizes up to 16k). The rounding
follows the reference step by step: statistics in float32, the normalized value cast to
the input dtype before the multiply by the weight, that product rounded once, and the
residual sum rounded to the input dtype before it is normalized. Only the order of the
mean-square sum differs, so low-precision outputs agree to the last bit almost always
and otherwise by one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_round import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_res, stride_out,
    H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), dt)
        tl.store(res_ptr + row * stride_res + cols, x.to(dt), mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    # rsqrt, like torch.rsqrt on each device (approximate on CUDA, exact in the interpreter).
    rstd = tl.math.rsqrt(var + eps)
    normed = round_to(xf * rstd, dt)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(normed * w, dt).to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, H]`` with a contiguous last dimension (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, res2, weight, out2, eps) -> None:
    rows, H = x2.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(H)
    warps = max(1, min(16, block // 512))
    _rms_norm_kernel[(rows,)](
        x2, res2 if res2 is not None else x2, weight, out2,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0),
        H, eps,
        HAS_RESIDUAL=res2 is not None, BLOCK=block, num_warps=warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`kernels.rms_norm.rms_norm`."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.rms_norm.fused_add_rms_norm`: one launch, the
    residual updated in place.

    Raises:
        ValueError: ``residual`` is not a ``[T, H]`` tensor with a contiguous last
            dimension (it is written through a row stride).
    """
    if residual.dim() != 2 or residual.stride(-1) != 1:
        raise ValueError(
            f"residual must be [T, H] with a contiguous last dimension, got shape "
            f"{tuple(residual.shape)} strides {residual.stride()}"
        )
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, residual, weight, out, eps)
    return out, residual
