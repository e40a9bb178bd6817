"""Plain-torch reference of the mixture of experts over GGUF blocks: the loop over
experts of :func:`kernels.moe.reference.fused_moe`, each expert's blocks dequantized by ``gguf``
(:func:`kernels.quant.reference.dequantize`) when it has tokens.

The yardstick of :mod:`kernels.moe.quant_triton_kernel` in tests, and the path a layer of
quantized experts takes off CUDA (slow: each routed expert's blocks travel through NumPy
on every call). The dequantized weights are cast to the activations' dtype, so on any
device this computes exactly what the same GGUF dequantized at load computes.
"""

from __future__ import annotations

import torch

from kernels.moe.reference import moe_by_expert
from kernels.quant.reference import dequantize


def check_expert_blocks(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        types: tuple[str, str, str], hidden: int, inter: int) -> None:
    """Refuse stacked blocks that do not hold ``[E, I, H]``, ``[E, I, H]``, ``[E, H, I]``
    weights of ``types`` (gate, up, down).

    Raises:
        ValueError: naming the projection, its type and shape.
    """
    from kernels.quant.formats import tensor_bytes

    for name, w, type_name, rows, cols in (("gate", w_gate, types[0], inter, hidden), ("up", w_up, types[1], inter, hidden),
                                           ("down", w_down, types[2], hidden, inter)):
        want = (w_gate.shape[0], rows, tensor_bytes(type_name, (1, cols), 0))
        if w.dtype != torch.uint8 or tuple(w.shape) != want:
            raise ValueError(f"{name} experts: want {type_name} blocks uint8 {want}, got {w.dtype} {tuple(w.shape)}")


def fused_moe_quant(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    types: tuple[str, str, str],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e =
    topk_ids[t, k]``, the experts' weights in GGUF blocks.

    Args:
        x: ``[T, H]`` hidden states (float32, bfloat16 or float16).
        w_gate, w_up: ``[E, I, H / block_elements * block_bytes]`` uint8, each expert's
            gate (up) rows as the GGUF's ``ffn_gate_exps`` (``ffn_up_exps``) holds them.
        w_down: ``[E, H, I / block_elements * block_bytes]`` uint8 (``ffn_down_exps``).
        types: the GGML type names of gate, up and down (``("Q4_K", "Q4_K", "Q6_K")``).
        topk_weights, topk_ids: ``[T, K]``, as :func:`kernels.moe.reference.fused_moe` takes them.

    Returns:
        ``[T, H]`` in ``x``'s dtype.

    Raises:
        ValueError: blocks that do not match ``types`` and ``x``'s width.
    """
    hidden, inter = x.shape[1], w_gate.shape[1]
    check_expert_blocks(w_gate, w_up, w_down, types, hidden, inter)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    return moe_by_expert(x, topk_weights, topk_ids,
                         lambda e: expert_weights(w_gate, w_up, w_down, types, e, x.dtype))


def expert_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, types: tuple[str, str, str],
                   expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s weights dequantized from stacked blocks (shapes as
    :func:`fused_moe_quant` takes them): ``([2I, H], [H, I])`` in ``dtype`` on the
    blocks' device, gate rows first, as :class:`engine.layers.moe.sparse_moe.Experts` stacks them.
    ``H`` is read from the down blocks' rows, ``I`` from the gate's."""
    hidden, inter = w_down.shape[1], w_gate.shape[1]
    gate_up = torch.cat([dequantize(w_gate[expert], types[0], hidden), dequantize(w_up[expert], types[1], hidden)])
    return gate_up.to(dtype), dequantize(w_down[expert], types[2], inter).to(dtype)
