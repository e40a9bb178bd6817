"""Mixture-of-experts routing and expert computation: the torch references.

:func:`route` turns router logits into each token's top-k experts and weights;
:func:`fused_moe` runs the routed experts (gate/up, SiLU-and-mul, down) and sums their
outputs weighted by the router. The reference loops over the experts that received
tokens, as transformers' ``Qwen3MoeExperts`` does, so on the CPU the engine computes
what transformers computes. :func:`align_to_blocks` is the token-to-expert sort the
Triton grouped GEMM (:mod:`kernels.moe.triton_kernel`) runs over; it is plain torch with
no host synchronisation, so it can run inside a captured CUDA graph.

Expert weights are stacked: ``w_gate_up`` ``[E, 2 * I, H]`` (gate rows first, then up),
``w_down`` ``[E, H, I]``, the layout transformers 5 keeps them in. gpt-oss's experts add
biases (:class:`ExpertBiases`) and their own activation
(:class:`kernels.activation.reference.ClampedSwiGLU`); the other families' have neither
(SiLU-and-mul).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation.reference import ClampedSwiGLU, silu_and_mul


@dataclass(frozen=True)
class ExpertBiases:
    """Biases of stacked experts: ``gate_up`` ``[E, 2 * I]`` (gate half first, as the
    weights' rows) and ``down`` ``[E, H]``, in the weights' dtype."""

    gate_up: torch.Tensor
    down: torch.Tensor


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, biases: ExpertBiases | None = None,
               expert: int = 0, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """One expert on ``x`` ``[T, H]``: ``down(act(gate_up(x)))`` with ``w_gate_up``
    ``[2I, H]``, ``w_down`` ``[H, I]``, row ``expert`` of ``biases`` (None: none) and
    ``activation`` (None: SiLU-and-mul). ``[T, H]`` in ``x``'s dtype."""
    gate_up = F.linear(x, w_gate_up, None if biases is None else biases.gate_up[expert])
    h = silu_and_mul(gate_up) if activation is None else activation(gate_up)
    return F.linear(h, w_down, None if biases is None else biases.down[expert])


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights.

    Softmax in float32 over all experts, then the top ``top_k`` probabilities, divided
    by their sum when ``renormalize`` (``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``,
    ``MixtralTopKRouter`` in transformers; Mixtral's original "top-k, then softmax over
    those" is the same value, since the softmax denominator cancels).

    Args:
        logits: ``[T, E]`` router logits, any float dtype.

    Returns:
        ``(weights, ids)``: ``[T, top_k]`` float32 and ``[T, top_k]`` int64, in
        descending weight order.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    biases: ExpertBiases | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, k]`` (with ``biases``, each projection's added; with
    ``activation``, it in place of SiLU-and-mul: :func:`expert_mlp`).

    Args:
        x: ``[T, H]`` hidden states.
        w_gate_up: ``[E, 2 * I, H]``, ``x``'s dtype.
        w_down: ``[E, H, I]``, ``x``'s dtype.
        topk_weights: ``[T, K]``; multiplied in their own dtype (float32 promotes the
            product, as transformers' Mixtral does; pass ``x``'s dtype to round first,
            as its Qwen and OLMoE routers do).
        topk_ids: ``[T, K]`` integer expert ids in ``[0, E)``.

    Returns:
        ``[T, H]`` in ``x``'s dtype. Each expert's weighted output is added in expert
        order, in ``x``'s dtype (``index_add_``), as transformers does.
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # HEADROOM_KERNELS=torch inside a CUDA graph: no host reads, so every expert
        # runs on every token and a token's weight for an expert it did not pick is 0.
        for e in range(w_gate_up.shape[0]):
            weight = (topk_weights * (topk_ids == e)).sum(dim=-1, keepdim=True)
            y = expert_mlp(x, w_gate_up[e], w_down[e], biases, e, activation) * weight
            out += y.to(x.dtype)
        return out
    return moe_by_expert(x, topk_weights, topk_ids, lambda e: (w_gate_up[e], w_down[e]), biases, activation)


def moe_by_expert(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    biases: ExpertBiases | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """:func:`fused_moe`'s loop over the experts that received tokens, expert ``e``'s
    ``([2I, H], [H, I])`` weights given by ``weights_of(e)`` (a stacked tensor's row, or
    GGUF blocks dequantized on demand: :mod:`kernels.moe.quant_reference`), its biases
    row ``e`` of ``biases``. Pairs with an id below 0 are left out. Reads the routed
    experts back to the host: the CPU path."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tokens, slots = torch.where(topk_ids == e)
        w_gate_up, w_down = weights_of(e)
        y = expert_mlp(x[tokens], w_gate_up, w_down, biases, e, activation) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


def padded_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Length of :func:`align_to_blocks`'s ``sorted_rows``: ``num_rows`` routed rows plus
    at most ``block_m - 1`` padding rows for each expert that can receive any, rounded
    up to whole blocks. Depends on shapes only, so a CUDA graph can hold it."""
    padded = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-padded // block_m) * block_m


def align_to_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the routed rows by expert, each expert's run padded to whole blocks of
    ``block_m`` rows, so one program of the grouped GEMM handles one block of one
    expert.

    A routed row is ``r = t * K + k`` (token ``t``'s ``k``-th choice).

    Args:
        topk_ids: ``[T, K]`` integer expert ids in ``[0, num_experts)``.

    Returns:
        ``(sorted_rows, block_experts, num_padded)``: ``sorted_rows`` ``[C]`` int32
        (``C`` = :func:`padded_capacity`), the routed rows grouped by expert in
        ascending expert order and, within one, in row order, padding entries set to
        ``T * K``; ``block_experts`` ``[C // block_m]`` int32, the expert of each block
        (blocks past ``num_padded`` hold a valid but unused id); ``num_padded`` ``[1]``
        int32, the used length of ``sorted_rows``.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    rows = flat.numel()
    dev = flat.device
    # scatter_add_ rather than bincount: bincount's output length depends on the data.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(rows, device=dev) - (counts.cumsum(0) - counts)[experts_sorted]
    capacity = padded_capacity(rows, num_experts, block_m)
    sorted_rows = torch.full((capacity,), rows, dtype=torch.int32, device=dev)
    sorted_rows[starts[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_rows, block_experts.to(torch.int32), ends[-1:].to(torch.int32)
