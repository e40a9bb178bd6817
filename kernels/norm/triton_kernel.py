"""Triton RMSNorm and residual-add + RMSNorm; references in :mod:`kernels.norm.reference`.

One program per row, the whole row in registers (hidden sizes up to 16k). The rounding
follows the reference step by step: statistics in float32, the normalized value cast to
the input dtype before the multiply by the weight, that product rounded once, and the
residual sum rounded to the input dtype before it is normalized. Only the order of the
mean-square sum differs, so low-precision outputs agree to the last bit almost always
and otherwise by one unit in the last place.

With ``quantize=True`` the kernel also writes its output rows quantized for the int8
GEMV (:class:`kernels.quant.triton_activations.Q8Activations`), from the output values as
stored (rounded to the output dtype), with the quantizing launch's own code
(:func:`kernels.quant.triton_activations.q8_groups`): the same codes, scales and sums bit for
bit as :func:`kernels.quant.triton_activations.quantize_activations` of the output, without
that launch. The output itself is the same either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.triton_activations import (
    Q8Activations,
    producer_activations,
    producer_args,
    q8_groups,
)
from kernels.triton_round import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, d_ptr, s_ptr,
    stride_x, stride_res, stride_out, stride_q, stride_d, stride_s,
    H, eps,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
):
    # QUANT: the output row also quantized into codes/scales/sums at q_ptr/d_ptr/s_ptr
    # (H a multiple of 32, so BLOCK is whole groups); else those are unused.
    # PDL (kernels.pdl): the projection after the norm may launch, and load its first
    # weights, once this kernel's inputs are ready.
    pdl.begin(PDL)
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
    y = round_to(normed * w, dt)  # the output's value, exact in float32
    tl.store(out_ptr + row * stride_out + cols, y.to(dt), mask=mask)
    if QUANT:
        # The float32 of the stored value, as the quantizing launch would load it; the
        # padding past H is zeros, in groups that are not stored.
        q8_groups(tl.reshape(y, (BLOCK // 32, 32)), q_ptr + row * stride_q, d_ptr + row * stride_d,
                   s_ptr + row * stride_s, tl.arange(0, BLOCK // 32), H // 32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, H]`` with a contiguous last dimension (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, res2, weight, out2, eps, q8: Q8Activations | None) -> None:
    rows, H = x2.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(H)
    warps = max(1, min(16, block // 512))
    quant, quant_strides = producer_args(q8, out2)
    _rms_norm_kernel[(rows,)](
        x2, res2 if res2 is not None else x2, weight, out2, *quant,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0), *quant_strides,
        H, eps,
        HAS_RESIDUAL=res2 is not None, QUANT=q8 is not None, BLOCK=block, num_warps=warps,
        **pdl.launch_args(x2.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, quantize: bool = False):
    """Same contract as :func:`kernels.norm.reference.rms_norm`.

    With ``quantize``: ``(out, q8)``, ``q8`` the output's rows ``[rows, H]`` quantized for
    the int8 GEMV in the same launch, equal to ``quantize_activations(out.reshape(-1, H))``
    bit for bit.

    Raises:
        ValueError: ``quantize`` and ``H`` not a multiple of 32.
    """
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    q8 = producer_activations(out, quantize)
    _launch(x2, None, weight, out, eps, q8)
    return (out.view(x.shape), q8) if quantize else out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, quantize: bool = False
):
    """Same contract as :func:`kernels.norm.reference.fused_add_rms_norm`: one launch, the
    residual updated in place.

    With ``quantize``: ``(out, residual, q8)``, ``q8`` as :func:`rms_norm`'s.

    Raises:
        ValueError: ``residual`` is not a ``[T, H]`` tensor with a contiguous last
            dimension (it is written through a row stride); ``quantize`` and ``H`` not a
            multiple of 32.
    """
    if residual.dim() != 2 or residual.stride(-1) != 1:
        raise ValueError(
            f"residual must be [T, H] with a contiguous last dimension, got shape "
            f"{tuple(residual.shape)} strides {residual.stride()}"
        )
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    q8 = producer_activations(out, quantize)
    _launch(x2, residual, weight, out, eps, q8)
    return (out, residual, q8) if quantize else (out, residual)
