"""Missing experts run on the CPU, from the expert cache's host tier: in their GGUF blocks
by the C kernels where they build and read the blocks' types (:mod:`kernels.cpu.moe_experts`:
all of a step's CPU experts in one call over the cores); elsewhere the expert cache runs
them one at a time through torch on dense weights (a block stack's dequantized by ``gguf``
on every run: far slower, so the choice is logged)."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from engine.layers.moe.expert_stacks import BlockStack, ExpertStack

log = logging.getLogger("headroom.engine")


def block_kernels_for(host: ExpertStack) -> ctypes.CDLL | None:
    """The C kernels for ``host``'s CPU runs, or None (a dense stack, a block type they do
    not read, or no build: the reason is logged)."""
    if not isinstance(host, BlockStack):
        return None
    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build
    from kernels.cpu.moe_experts import takes

    if not takes(host.types):
        log.info("CPU expert runs: torch, dequantizing each run (no C kernel reads %s)", "/".join(host.types))
        return None
    lib = cpu_kernels()
    if lib is None:
        log.warning("CPU expert runs: torch, dequantizing each run, slower (the C kernels are off: %s)",
                    build.why_not())
        return None
    log.info("CPU expert runs: the C kernels over the %s blocks", "/".join(host.types))
    return lib


@dataclass(frozen=True)
class CpuRun:
    """A step's routed pairs for the C kernels, read back to the host: ``rows`` (int64
    ``[T']``, sorted, on the step's device) are the tokens routed to a CPU-run expert,
    ``x`` their float32 ``[T', H]`` hidden states on the CPU; per pair, ``local`` (its
    row in ``x``), ``experts`` and ``weights`` (int64, int64, float32 ``[P]``)."""

    rows: torch.Tensor
    x: torch.Tensor
    local: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


def gather_cpu_run(num_experts: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   experts: set[int]) -> CpuRun:
    """The routed pairs of ``topk_ids`` (``[T, K]``, ``x``'s device) whose expert is in
    ``experts``, read back to the host with their tokens' rows of ``x`` (``[T, H]``).

    Read back before the step's GPU work on the cached experts is queued, these copies
    wait for nothing, and the CPU's kernels then run while the GPU computes
    (:func:`compute_cpu_run`)."""
    wanted = torch.zeros(num_experts, dtype=torch.bool)
    wanted[sorted(experts)] = True
    ids = topk_ids.cpu()
    tokens, ks = torch.where(wanted[ids])
    rows, local = torch.unique(tokens, return_inverse=True)
    xh = x[rows.to(x.device)].to("cpu", torch.float32)
    return CpuRun(rows.to(x.device), xh, local, ids[tokens, ks], topk_weights.cpu()[tokens, ks].float())


def compute_cpu_run(host: BlockStack, lib: ctypes.CDLL, run: CpuRun) -> torch.Tensor:
    """``sum_k weight * expert(x)`` of ``run``'s pairs by the C kernels from ``host``'s
    blocks in one call over the cores: float32 ``[T', H]`` on the CPU, row ``i`` for token
    ``run.rows[i]``."""
    from kernels.cpu.moe_experts import moe_experts

    return moe_experts(lib, run.x, run.local, run.experts, run.weights, host.gate, host.up, host.down, host.types)
