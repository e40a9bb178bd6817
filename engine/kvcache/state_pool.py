"""The state pool of hybrid linear-attention models: per-request recurrent and conv states.

A Gated DeltaNet layer keeps no per-token cache: a running request's whole past is one
recurrent state ``[Hv, Dk, Dv]`` (float32: the recurrence accumulates over the whole
context) and one conv state ``[conv_dim, K - 1]`` (model dtype) per linear layer. The
pool holds ``max_requests`` such slots plus slot 0, a null slot never handed out, so its
bytes are fixed by the number of requests, not by their lengths: the memory plan gives
it its own line beside the KV pool and bounds the running requests by it.

A request takes a slot at admission and gives it back whenever it gives back its pages
(finish, abort, preemption, a rolled-back admission): its states are only valid with
its KV pages, and a preempted request recomputes both.

Prefix reuse: the radix cache shares KV pages, but a linear layer's state after a shared
prefix cannot be rebuilt from them. So the pool also holds ``checkpoints`` slots: a copy
of a request's states taken when its computed tokens end on a page boundary
(:meth:`StatePool.save`), which the radix cache keeps at the node ending there
(:class:`engine.kvcache.radix.RadixCache`). A later request that shares the prefix copies
it into its own slot (:meth:`StatePool.restore`) and computes only the rest. When every
checkpoint slot is taken, the least recently used checkpoint is given up (its node keeps
its pages; a match then stops at an earlier checkpoint).
"""

from __future__ import annotations

import torch

from engine.common.config import ModelConfig


class OutOfStateSlots(RuntimeError):
    """Every state slot is held by a running request."""


def state_bytes_per_request(mc: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one request's states take over all linear layers (0 for a model without).

    Recurrent: ``Hv * Dk * Dv * 4`` (float32); conv: ``(2 * Hk * Dk + Hv * Dv) * (K - 1)``
    elements of ``dtype``; times the linear layers.
    """
    layers = len(mc.linear_layers)
    if layers == 0:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    ssm = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
    conv_dim = 2 * mc.linear_num_key_heads * mc.linear_key_head_dim + mc.linear_num_value_heads * mc.linear_value_head_dim
    conv = conv_dim * (mc.linear_conv_kernel_dim - 1) * itemsize
    return layers * (ssm + conv)


class StatePool:
    """``conv[i]`` ``[max_requests + 1 + checkpoints, conv_dim, K - 1]`` (dtype) and
    ``ssm[i]`` ``[max_requests + 1 + checkpoints, Hv, Dk, Dv]`` (float32) for the ``i``-th
    linear layer; the free lists of request slots ``1..max_requests`` and of checkpoint
    slots after them.

    Raises (constructor):
        ValueError: ``max_requests < 1``, ``checkpoints < 0`` or a model without
            linear-attention layers.
    """

    def __init__(self, mc: ModelConfig, max_requests: int, dtype: torch.dtype, device: torch.device | str,
                 checkpoints: int = 0) -> None:
        if max_requests < 1:
            raise ValueError(f"the state pool needs at least one slot, got {max_requests}")
        if checkpoints < 0:
            raise ValueError(f"checkpoints must be >= 0, got {checkpoints}")
        if not mc.is_hybrid:
            raise ValueError(f"{mc.architecture} has no linear-attention layers: it needs no state pool")
        n = max_requests + 1 + checkpoints
        conv_dim = 2 * mc.linear_num_key_heads * mc.linear_key_head_dim + mc.linear_num_value_heads * mc.linear_value_head_dim
        layers = len(mc.linear_layers)
        self.conv = [torch.zeros(n, conv_dim, mc.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                     for _ in range(layers)]
        self.ssm = [torch.zeros(n, mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim,
                                dtype=torch.float32, device=device) for _ in range(layers)]
        self.max_requests = max_requests
        self.checkpoints = checkpoints
        self._free = list(range(max_requests, 0, -1))
        self._free_checkpoints = list(range(n - 1, max_requests, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.conv) + sum(t.nbytes for t in self.ssm)

    def alloc(self) -> int:
        """A free slot (its contents are stale: a sequence with no prefix starts from zeros).

        Raises:
            OutOfStateSlots: none is free.
        """
        if not self._free:
            raise OutOfStateSlots(f"all {self.max_requests} state slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Raises ValueError for the null slot, one out of range or already free."""
        if not 1 <= slot <= self.max_requests or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)

    # -- prefix-cache checkpoints ---------------------------------------------------------

    @property
    def num_free_checkpoints(self) -> int:
        return len(self._free_checkpoints)

    def _copy(self, src: int, dst: int) -> None:
        for conv, ssm in zip(self.conv, self.ssm, strict=True):
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

    def save(self, slot: int) -> int | None:
        """Copy request slot ``slot``'s states into a free checkpoint slot; returns it,
        or None when none is free (the caller frees one and asks again, or goes without)."""
        if not self._free_checkpoints:
            return None
        checkpoint = self._free_checkpoints.pop()
        self._copy(slot, checkpoint)
        return checkpoint

    def restore(self, checkpoint: int, slot: int) -> None:
        """Copy ``checkpoint``'s states into request slot ``slot`` (the checkpoint stays)."""
        self._copy(checkpoint, slot)

    def free_checkpoint(self, checkpoint: int) -> None:
        """Give a checkpoint slot back. Raises ValueError for one that is not a held checkpoint."""
        if not self.max_requests < checkpoint <= self.max_requests + self.checkpoints \
                or checkpoint in self._free_checkpoints:
            raise ValueError(f"checkpoint slot {checkpoint} is not held")
        self._free_checkpoints.append(checkpoint)
