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

from kernels.activation.reference import ClampedSwiGLU
from kernels.moe.reference import ExpertBiases, moe_by_expert
from kernels.quant.reference import dequantize

# ``slot_of``'s code for an expert left out of the sums (the CPU's share of a host
# layer computes it); the Triton kernel's ``SKIP_SLOT``.
SKIP_SLOT = -2


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
    *,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    slot_of: torch.Tensor | None = None,
    biases: ExpertBiases | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e =
    topk_ids[t, k]``, the experts' weights in GGUF blocks (with ``biases``, each
    projection's added; with ``activation``, it in place of SiLU-and-mul, as
    :func:`kernels.moe.reference.expert_mlp`: gpt-oss's experts).

    Args:
        x: ``[T, H]`` hidden states (float32, bfloat16 or float16).
        w_gate, w_up: ``[E, I, H / block_elements * block_bytes]`` uint8, each expert's
            gate (up) rows as the GGUF's ``ffn_gate_exps`` (``ffn_up_exps``) holds them.
        w_down: ``[E, H, I / block_elements * block_bytes]`` uint8 (``ffn_down_exps``).
        types: the GGML type names of gate, up and down (``("Q4_K", "Q4_K", "Q6_K")``).
        topk_weights, topk_ids: ``[T, K]``, as :func:`kernels.moe.reference.fused_moe` takes them.
        cache: an expert cache's ``(gate, up, down)`` stacks of ``S`` slots, laid out as
            the ``w_*`` stacks; with ``slot_of`` (int64 ``[E]`` on ``x``'s device: each
            expert's slot, or -1), an expert with a slot is read from the cache instead,
            and one whose entry is :data:`SKIP_SLOT` is left out (its pairs add
            nothing: another device computes them).
        biases: ``gate_up`` ``[E, 2I]`` (gate half first) and ``down`` ``[E, H]``, in
            ``x``'s dtype on its device (not with ``cache``: such experts stay on the device).
        activation: gpt-oss's clamped SwiGLU, or None for SiLU-and-mul.

    Returns:
        ``[T, H]`` in ``x``'s dtype.

    Raises:
        ValueError: blocks that do not match ``types`` and ``x``'s width; a ``cache``
            without ``slot_of`` (or the reverse), or of another layout.
    """
    hidden, inter = x.shape[1], w_gate.shape[1]
    check_expert_blocks(w_gate, w_up, w_down, types, hidden, inter)
    check_cache(cache, slot_of, w_gate, w_up, w_down, biases)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if cache is None:
        return moe_by_expert(x, topk_weights, topk_ids,
                             lambda e: expert_weights(w_gate, w_up, w_down, types, e, x.dtype), biases, activation)
    # Slots numbered after the stacks' experts: one loop over both sources; a skipped
    # expert's pairs get no key (moe_by_expert leaves ids below 0 out).
    num_experts = w_gate.shape[0]
    slots = slot_of[topk_ids]
    keys = torch.where(slots >= 0, slots.to(topk_ids.dtype) + num_experts, topk_ids)
    keys = torch.where(slots == SKIP_SLOT, -1, keys)
    return moe_by_expert(x, topk_weights, keys, lambda k: (
        expert_weights(w_gate, w_up, w_down, types, k, x.dtype) if k < num_experts
        else expert_weights(*cache, types, k - num_experts, x.dtype)))


def check_cache(cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, slot_of: torch.Tensor | None,
                w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                biases: ExpertBiases | None = None) -> None:
    """Check :func:`fused_moe_quant`'s ``cache`` and ``slot_of`` against its stacks (and
    ``biases``, which must be ``[E, 2I]`` and ``[E, H]``).

    Raises:
        ValueError: one given without the other, a cache stack whose expert layout or
            dtype differs from its ``w_*`` stack, ``slot_of`` not int64 ``[E]``, a cache
            with biases (experts with biases are not offloaded), or biases of another
            shape.
    """
    if (cache is None) != (slot_of is None):
        raise ValueError("an expert cache needs slot_of, and slot_of a cache")
    if biases is not None:
        want = ((w_gate.shape[0], 2 * w_gate.shape[1]), (w_gate.shape[0], w_down.shape[1]))
        if (tuple(biases.gate_up.shape), tuple(biases.down.shape)) != want:
            raise ValueError(f"expert biases {tuple(biases.gate_up.shape)} and {tuple(biases.down.shape)} are not "
                             f"gate_up {want[0]} and down {want[1]}")
        if cache is not None:
            raise ValueError("experts with biases are not read from an expert cache; keep them all on the device")
    if cache is None:
        return
    for name, c, w in zip(("gate", "up", "down"), cache, (w_gate, w_up, w_down), strict=True):
        if c.shape[1:] != w.shape[1:] or c.dtype != w.dtype or c.stride() != w.stride():
            raise ValueError(f"the cache's {name} {c.dtype} {tuple(c.shape)} does not hold experts laid out as the "
                             f"stack's {w.dtype} {tuple(w.shape)}")
    if slot_of.shape != (w_gate.shape[0],) or slot_of.dtype != torch.int64:
        raise ValueError(f"slot_of {slot_of.dtype} {tuple(slot_of.shape)} is not int64 [{w_gate.shape[0]}]")


def expert_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, types: tuple[str, str, str],
                   expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s weights dequantized from stacked blocks (shapes as
    :func:`fused_moe_quant` takes them): ``([2I, H], [H, I])`` in ``dtype`` on the
    blocks' device, gate rows first, as :class:`engine.layers.moe.sparse_moe.Experts` stacks them.
    ``H`` is read from the down blocks' rows, ``I`` from the gate's."""
    hidden, inter = w_down.shape[1], w_gate.shape[1]
    gate_up = torch.cat([dequantize(w_gate[expert], types[0], hidden), dequantize(w_up[expert], types[1], hidden)])
    return gate_up.to(dtype), dequantize(w_down[expert], types[2], inter).to(dtype)
