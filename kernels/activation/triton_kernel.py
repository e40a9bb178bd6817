"""Triton SiLU-and-mul; reference in :mod:`kernels.activation.reference`.

Rounds like the reference: ``silu(gate)`` is computed in float32 and rounded to the
input dtype, then multiplied by ``up`` and rounded again.

With ``quantize=True`` the kernel also writes its output rows quantized for the int8
GEMV of the down projection, as :mod:`kernels.norm.triton_kernel` does (the same codes as
:func:`kernels.quant.triton_activations.quantize_activations` of the output, bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.triton_activations import producer_activations, producer_args, q8_groups
from kernels.triton_round import round_to

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, d_ptr, s_ptr, stride_x, stride_out, stride_q, stride_d, stride_s,
                         inter, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    # QUANT: the output also quantized into codes/scales/sums at q_ptr/d_ptr/s_ptr
    # (inter a multiple of 32, so a program's BLOCK columns are whole groups).
    # PDL (kernels.pdl): the down projection may launch, and load its first weights,
    # once this kernel's inputs are ready.
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dt)
    y = round_to(act * up, dt)  # the output's value, exact in float32
    tl.store(out_ptr + row * stride_out + cols, y.to(dt), mask=mask)
    if QUANT:
        # As the quantizing launch would load the stored value; the padding past inter
        # is zeros, in groups that are not stored.
        q8_groups(tl.reshape(y, (BLOCK // 32, 32)), q_ptr + row * stride_q, d_ptr + row * stride_d,
                   s_ptr + row * stride_s, tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32), inter // 32)


def silu_and_mul(x: torch.Tensor, *, quantize: bool = False):
    """Same contract as :func:`kernels.activation.reference.silu_and_mul`.

    With ``quantize``: ``(out, q8)``, ``q8`` the output's rows ``[rows, I]`` quantized for
    the int8 GEMV in the same launch, equal to ``quantize_activations(out.reshape(-1, I))``
    bit for bit.

    Raises:
        ValueError: ``quantize`` and ``I`` not a multiple of 32.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    q8 = producer_activations(out, quantize)
    if rows and inter:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        quant, quant_strides = producer_args(q8, out)
        _silu_and_mul_kernel[grid](x2, out, *quant, x2.stride(0), out.stride(0), *quant_strides, inter,
                                   QUANT=q8 is not None, BLOCK=block, num_warps=4, **pdl.launch_args(x.device))
    out = out.view(*x.shape[:-1], inter)
    return (out, q8) if quantize else out
