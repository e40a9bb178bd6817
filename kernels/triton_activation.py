"""Triton SiLU-and-mul; reference in :mod:`kernels.activation`.

Rounds like the reference: ``silu(gate)`` is computed in float32 and rounded to the
input dtype, then multiplied by ``up`` and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_round import round_to

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dt)
    tl.store(out_ptr + row * stride_out + cols, round_to(act * up, dt).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.activation.silu_and_mul`."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows and inter:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inter)
