"""Split-K for the block GEMVs and GEMMs: how many K ranges a launch takes
(:func:`split_k_ranges`), where each range writes its float32 partial sums
(:func:`partials_at`, :func:`split_output`) and their sum in a fixed order
(:func:`sum_partials`). Not atomics: their order changes from run to run (and with
launch overlap, :mod:`kernels.pdl`), so would the rounding of a step's output; this way a
step gives the same bits every time."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_ranges(nblocks: int, blocks_per_step: int, programs: int, device: torch.device,
                   split_k: int | None = None) -> tuple[int, int]:
    """How a GEMV of ``programs`` (activation rows x weight tiles) splits K, shared by the
    float and the int8 GEMV: ``(blocks per range, ranges)``. ``split_k`` forces the number
    of ranges; by default enough for four programs per SM (one range off CUDA), never
    more than the steps K holds. Above one range each writes its float32 partial sums
    (:func:`split_output`)."""
    if split_k is None:
        want = 4 * sm_count(device.index or 0) if device.type == "cuda" else 1
        split_k = max(1, min(nblocks // blocks_per_step or 1, -(-want // programs)))
    per_split = triton.cdiv(nblocks, split_k)
    return per_split, triton.cdiv(nblocks, per_split)


@triton.jit
def partials_at(out_ptr, pid_k, M, stride_om, PARTIALS: tl.constexpr):
    """Where K range ``pid_k`` of a launch writes: with PARTIALS (split-K), its own
    float32 ``[M, N]`` plane of a ``[ranges, M, N]`` output (:func:`split_output`), else
    ``out_ptr`` itself."""
    if PARTIALS:
        out_ptr += pid_k.to(tl.int64) * M * stride_om
    return out_ptr


def split_output(result: torch.Tensor, ranges: int) -> torch.Tensor:
    """The output a launch over ``ranges`` K ranges writes: ``result`` itself for one,
    else float32 ``[ranges, M, N]`` partial sums, one plane a range, which
    :func:`sum_partials` adds in a fixed order."""
    if ranges == 1:
        return result
    return torch.empty((ranges, *result.shape), device=result.device, dtype=torch.float32)


def sum_partials(result: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """``result`` with :func:`split_output`'s planes summed into it (nothing to do for
    one range)."""
    if dest is not result:
        result.copy_(dest.sum(0))
    return result
