"""A layer's routed experts stacked along their first dimension, in one storage form:
what the host tier and the cache tier of :mod:`engine.layers.moe.expert_cache` hold.

- :class:`DenseStack`: ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]`` in the
  model dtype (:class:`engine.layers.moe.sparse_moe.Experts`);
- :class:`BlockStack`: the GGUF's blocks as they are, uint8 ``gate``/``up``
  ``[E, I, row_bytes]`` and ``down`` ``[E, H, row_bytes]``, one GGML type each
  (:class:`engine.layers.moe.quant_experts.QuantExperts`). A copy between tiers moves the
  blocks: about a quarter (Q4_K) to a third (Q6_K) of the bfloat16 bytes.

The expert cache moves experts between two stacks of the same form and asks a stack
for three things: its fused product over routed ids (:meth:`ExpertStack.moe`, the ids
naming this stack's rows: an expert's in the host tier, a slot's in the cache tier),
one expert's dense weights for a run outside the kernels (:meth:`ExpertStack.weights_of`)
and its bytes per expert.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from engine.layers.pinned_host import pinned_copy
from kernels.dispatch import fused_moe, fused_moe_quant
from kernels.moe.quant_reference import expert_weights


@dataclass(frozen=True)
class ExpertStack:
    """Base of the storage forms: the tensors named in ``TENSORS``, each ``[E, ...]``
    with the same ``E``, on one device."""

    TENSORS: ClassVar[tuple[str, ...]] = ()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.TENSORS)

    @property
    def num_experts(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes over every tensor (a cache slot's device memory)."""
        return sum(t.element_size() * math.prod(t.shape[1:]) for t in self.tensors)

    @property
    def cpu_dtype(self) -> torch.dtype:
        """The dtype an expert run on the CPU computes in."""
        raise NotImplementedError

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ExpertStack:
        return dataclasses.replace(self, **{name: fn(getattr(self, name)) for name in self.TENSORS})

    def empty(self, num_experts: int, device: torch.device) -> ExpertStack:
        """A stack of this form with room for ``num_experts`` experts on ``device``
        (uninitialized)."""
        return self._map(lambda t: torch.empty(num_experts, *t.shape[1:], dtype=t.dtype, device=device))

    def head(self, num_experts: int) -> ExpertStack:
        """The first ``num_experts`` experts, contiguous (views of a contiguous stack)."""
        return self._map(lambda t: t[:num_experts].contiguous())

    def on_host(self, pin: bool) -> ExpertStack:
        """This stack in host memory, contiguous (page-locked when ``pin``, exactly its
        bytes: :func:`~engine.layers.pinned_host.pinned_copy`; the device's copies from it
        then run asynchronously, and a kernel reads it over the bus)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if pin:  # exactly its bytes locked (pin_memory would round up to a power of two)
                return pinned_copy(t)
            return t.detach().to("cpu").contiguous()

        return self._map(move)

    def copy_in(self, row: int, source: ExpertStack, expert: int, non_blocking: bool = False) -> None:
        """Write ``source``'s expert ``expert`` (a stack of the same form) into row
        ``row``."""
        for dst, src in zip(self.tensors, source.tensors, strict=True):
            dst[row].copy_(src[expert], non_blocking=non_blocking)

    def weights_of(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``expert``'s dense ``([2I, H], [H, I])`` weights in ``dtype`` on this
        stack's device (gate rows first)."""
        raise NotImplementedError

    def moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The fused mixture of experts over this stack: ``x`` ``[T, H]``,
        ``topk_weights``/``topk_ids`` ``[T, K]`` (ids are rows of this stack) ->
        ``[T, H]`` in ``x``'s dtype."""
        raise NotImplementedError


@dataclass(frozen=True)
class DenseStack(ExpertStack):
    """``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, in the model dtype."""

    TENSORS: ClassVar[tuple[str, ...]] = ("gate_up", "down")
    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def cpu_dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    def weights_of(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up[expert].to(dtype), self.down[expert].to(dtype)

    def moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids)


@dataclass(frozen=True)
class BlockStack(ExpertStack):
    """GGUF blocks, uint8: ``gate``/``up`` ``[E, I, H / block_elements * block_bytes]``
    and ``down`` ``[E, H, I / ...]``, of the GGML types ``types`` (gate, up, down)."""

    TENSORS: ClassVar[tuple[str, ...]] = ("gate", "up", "down")
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    types: tuple[str, str, str]

    @property
    def cpu_dtype(self) -> torch.dtype:
        # The blocks dequantize to float32; a CPU runs that faster than bfloat16, and
        # nothing is rounded that the kernels keep exact.
        return torch.float32

    def weights_of(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return expert_weights(self.gate, self.up, self.down, self.types, expert, dtype)

    def moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            cache: BlockStack | None = None, slot_of: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`ExpertStack.moe`; with ``cache`` (a stack of slots, same form) and
        ``slot_of`` (int64 ``[E]``, each expert's slot or -1), an expert with a slot is
        read there (:func:`kernels.moe.quant_reference.fused_moe_quant`)."""
        tiers = {} if cache is None else {"cache": (cache.gate, cache.up, cache.down), "slot_of": slot_of}
        return fused_moe_quant(x, self.gate, self.up, self.down, self.types, topk_weights, topk_ids, **tiers)


def stack_of(experts: nn.Module) -> ExpertStack:
    """The stack a layer's resident experts module holds (its tensors, not copies).

    Raises:
        ValueError: ``experts`` is neither :class:`~engine.layers.moe.sparse_moe.Experts` nor
            :class:`~engine.layers.moe.quant_experts.QuantExperts` (already offloaded, say),
            or has biases or an activation other than SiLU-and-mul (gpt-oss's).
    """
    from engine.layers.moe.quant_experts import QuantExperts
    from engine.layers.moe.sparse_moe import Experts

    if isinstance(experts, Experts | QuantExperts):
        if experts.biases is not None or experts.activation is not None:
            raise ValueError("gpt-oss's routed experts (biases, clamped SwiGLU) cannot be offloaded yet; "
                             "they stay on the device: give the model room for all of them")
    if isinstance(experts, Experts):
        return DenseStack(experts.gate_up_proj.detach(), experts.down_proj.detach())
    if isinstance(experts, QuantExperts):
        return BlockStack(experts.gate, experts.up, experts.down, experts.types)
    raise ValueError(f"cannot offload routed experts held as {type(experts).__name__}")
