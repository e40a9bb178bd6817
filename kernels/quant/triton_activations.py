"""Decode activations rounded to int8 for the int8 GEMV (:mod:`kernels.quant.triton_int8`),
as llama.cpp's ``quantize_q8_1`` rounds them: int8 codes, one float32 scale per 32
values (``scale = amax / 127``, codes rounded half away from zero) and the codes' sum
per 16 (:class:`Q8Activations`).

:func:`q8_groups` is the one place the codes are made: the quantizing launch
(:func:`quantize_activations`), the kernels that write a row and quantize it as they do
(the producers: :mod:`kernels.norm.triton_kernel`, :mod:`kernels.activation.triton_kernel`,
the attention's split merge in :mod:`kernels.attention.triton_kernel`, with
``quantize=True``; their buffers from :func:`producer_activations`) and the GEMV's own
``QUANT_X`` mode (through :func:`q8_inv`, :func:`q8_round`, :func:`q8_scale`) all give
the same codes, scales and sums bit for bit from the same float32 values. The torch
twin is :func:`kernels.quant.reference.quantize_activations`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl

# Activations per int8 scale (llama.cpp's block_q8_1), and per code sum.
GROUP = 32
SUM_GROUP = 16


class Q8Activations(NamedTuple):
    """Activation rows quantized for :func:`int8_gemv` (:func:`quantize_activations`).

    Attributes:
        codes: int8 ``[M, K]``; ``x ~= codes * scale`` of their group of 32.
        scales: float32 ``[M, K / 32]``.
        sums: int32 ``[M, K / 16]``, the codes' sum per 16.
        dtype: the activations' dtype (the GEMV's output dtype).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor
    dtype: torch.dtype


@triton.jit
def q8_inv(amax):
    """``127 / amax`` per group (0 for a group of zeros), float32 of ``amax``'s shape.
    Shared by :func:`_quantize_kernel` and the GEMV's ``QUANT_X`` mode, so both round
    the same way; correctly rounded (Triton's ``/`` is approximate), so the codes equal
    the torch reference's bit for bit."""
    return tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)


@triton.jit
def q8_scale(amax):
    """The float32 scale ``amax / 127`` of a group (correctly rounded, as :func:`q8_inv`)."""
    return tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def q8_round(v):
    """int32 codes of ``v = x * 127 / amax``, rounded half away from zero (``quantize_q8_1``'s
    ``roundf``)."""
    return tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)


@triton.jit
def q8_groups(x, q_row, d_row, s_row, g1, groups):
    """Quantize groups of 32 activations of one row and store them as
    :class:`Q8Activations` hold them: ``x`` float32 ``[G, 32]`` (row ``i`` is group
    ``g1[i]``, ``g1`` int32 ``[G]``), ``q_row``/``d_row``/``s_row`` that row's codes (int8),
    scales (float32) and sums (int32); groups ``>= groups`` are not stored. The one place
    the codes are made: :func:`_quantize_kernel` and the kernels that write a row and
    quantize it as they do (:mod:`kernels.norm.triton_kernel`, :mod:`kernels.activation.triton_kernel`)
    call it, so they give the same codes, scales and sums bit for bit from the same
    float32 values."""
    g = g1[:, None]
    t = tl.arange(0, 32)[None, :]
    amax = tl.max(tl.abs(x), axis=1)
    q = q8_round(x * q8_inv(amax)[:, None])
    tl.store(q_row + g * 32 + t, q.to(tl.int8), mask=g < groups)
    live = g1 < groups
    tl.store(d_row + g1, q8_scale(amax), mask=live)
    tl.store(s_row + 2 * g1, tl.sum(tl.where(t < 16, q, 0), axis=1), mask=live)
    tl.store(s_row + 2 * g1 + 1, tl.sum(tl.where(t >= 16, q, 0), axis=1), mask=live)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, s_ptr, groups, stride_xm, stride_qm, stride_dm, stride_sm, G: tl.constexpr,
                     PDL: tl.constexpr = 0):
    pdl.begin(PDL)  # the GEMV after it may load its first weights meanwhile
    m = tl.program_id(0).to(tl.int64)
    g1 = tl.program_id(1) * G + tl.arange(0, G)
    t = tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m * stride_xm + g1[:, None] * 32 + t, mask=g1[:, None] < groups, other=0.0).to(tl.float32)
    q8_groups(x, q_ptr + m * stride_qm, d_ptr + m * stride_dm, s_ptr + m * stride_sm, g1, groups)


def empty_activations(m: int, k: int, device: torch.device, dtype: torch.dtype) -> Q8Activations:
    """Uninitialized :class:`Q8Activations` for ``m`` rows of ``k`` activations of
    ``dtype`` (a kernel writes them: :func:`quantize_activations`, or the norm or
    activation kernel that makes the rows, ``quantize=True``).

    Raises:
        ValueError: ``k`` not a multiple of 32 (a scale's group).
    """
    if k % GROUP:
        raise ValueError(f"int8 activations come in groups of {GROUP}: a row of {k} is not whole groups")
    groups = k // GROUP
    return Q8Activations(torch.empty((m, k), device=device, dtype=torch.int8),
                         torch.empty((m, groups), device=device, dtype=torch.float32),
                         torch.empty((m, 2 * groups), device=device, dtype=torch.int32), dtype)


def producer_activations(out: torch.Tensor, quantize: bool) -> Q8Activations | None:
    """For a kernel that writes the rows ``out [rows, K]`` and, asked to (``quantize``),
    quantizes them as it does (:mod:`kernels.norm.triton_kernel`,
    :mod:`kernels.activation.triton_kernel`): the buffers it fills, else None.

    Raises:
        ValueError: ``quantize`` and ``K`` not a multiple of 32.
    """
    if not quantize:
        return None
    if out.shape[1] % GROUP:
        raise ValueError(f"quantize=True needs rows of whole groups of {GROUP} activations, got {out.shape[1]}")
    return empty_activations(*out.shape, out.device, out.dtype)


def producer_args(q8: Q8Activations | None, stand_in: torch.Tensor) -> tuple[tuple, tuple]:
    """Such a kernel's codes, scales and sums arguments and their row strides; without
    ``q8`` it leaves them unused (its ``QUANT`` off) and ``stand_in`` fills them."""
    if q8 is None:
        return (stand_in, stand_in, stand_in), (0, 0, 0)
    quant = (q8.codes, q8.scales, q8.sums)
    return quant, tuple(t.stride(0) for t in quant)


def quantize_activations(x: torch.Tensor) -> Q8Activations:
    """``x [M, K]`` (float32/bfloat16/float16, unit column stride, ``K % 32 == 0``) to
    int8 codes with a float32 scale per 32 values (:class:`Q8Activations`); the torch
    twin is :func:`kernels.quant.reference.quantize_activations`.

    Raises:
        ValueError: ``x`` not 2-D with whole groups of 32 and a unit column stride.
    """
    if x.dim() != 2 or x.shape[1] % GROUP or x.stride(1) != 1:
        raise ValueError(f"want x [M, K] with K a multiple of {GROUP} and unit column stride, got {tuple(x.shape)}")
    m, k = x.shape
    groups = k // GROUP
    q8 = empty_activations(m, k, x.device, x.dtype)
    g = 32
    _quantize_kernel[(m, triton.cdiv(groups, g))](x, q8.codes, q8.scales, q8.sums, groups, x.stride(0),
                                                  q8.codes.stride(0), q8.scales.stride(0), q8.sums.stride(0), G=g,
                                                  num_warps=4, **pdl.launch_args(x.device))
    return q8
