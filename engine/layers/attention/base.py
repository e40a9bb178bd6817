"""The attention backend interface.

A backend reads and writes the paged KV pool. The model calls
:meth:`AttentionBackend.forward` once per layer; :meth:`prepare` runs once per step, so
per-step metadata (gathered slot indices, masks) is built once and shared by all layers.

The backends by name, and the choice of one for a device, are in
:mod:`engine.layers.attention.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from engine.common.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool


class AttentionBackend(ABC):
    """Paged attention over a :class:`KVPool`.

    Attributes:
        workspace_bytes: fixed device memory the backend allocates for itself, in bytes,
            when it does not depend on the model (else see :meth:`workspace_size`).
        supports_cuda_graphs: :meth:`prepare` and :meth:`forward` of a decode batch whose
            device tensors the runner filled issue no host sync and no host-to-device
            copy while a CUDA graph is being captured, so a decode step can be captured
            and replayed; host work the kernels need per step goes in :meth:`graph_plan`.
        gathers_context: a prefill chunk or decode group copies its context's keys and
            values out of the pool (a transient that grows with the context, which the
            plan's activation estimate charges); False for kernels that read the pages
            in place.
        supports_windows: :meth:`use_windows` may limit layers to a sliding window.
        supports_softcap: :meth:`use_windows` may soft-cap the scores.
        windows: per pool layer, the tokens it attends to (0: the whole context); empty
            while every layer sees the whole context.
        softcap: scores capped at ``±softcap`` by ``softcap * tanh(s / softcap)`` before
            the mask and softmax (0: none).
        supports_sinks: :meth:`forward` takes ``sinks``, a logit per head that joins the
            softmax's denominator (gpt-oss).
        kv_block_formats: the block formats of ``--kv-cache-dtype`` (``q8_0``, ``q4_0``)
            whose pages the backend reads (:mod:`kernels.attention.kv_store`); another
            is refused before anything loads
            (:func:`engine.layers.attention.registry.resolve_backend_name`).
    """

    workspace_bytes: int = 0
    supports_cuda_graphs: bool = False
    gathers_context: bool = False
    supports_windows: bool = False
    supports_softcap: bool = False
    supports_sinks: bool = False
    kv_block_formats: tuple[str, ...] = ()
    windows: tuple[int, ...] = ()
    softcap: float = 0.0

    def __init__(self, pool: KVPool, *, num_heads: int, head_dim: int, scale: float, max_batch: int = 64) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.max_batch = max_batch

    def use_windows(self, windows: tuple[int, ...], softcap: float = 0.0) -> None:
        """Limit pool layer ``i`` to the last ``windows[i]`` tokens (the query's own
        included; 0: the whole context) and soft-cap the scores at ``softcap`` (0: none).

        Raises:
            ValueError: a window or a cap this backend does not implement.
        """
        if any(windows) and not self.supports_windows or softcap and not self.supports_softcap:
            what = "sliding-window" if any(windows) and not self.supports_windows else "soft-capped"
            raise ValueError(f"the {type(self).__name__} has no {what} attention; use --attention-backend torch")
        self.windows, self.softcap = tuple(windows) if any(windows) else (), float(softcap)

    @classmethod
    def workspace_size(cls, *, num_heads: int, num_kv_heads: int, head_dim: int, max_batch: int) -> int:
        """Fixed device memory, in bytes, the backend allocates for a model of these
        shapes serving up to ``max_batch`` sequences per step; declared so the memory
        plan can charge it before the KV pool is sized."""
        return cls.workspace_bytes

    def graph_plan(self, batch_size: int, seq_lens: np.ndarray, page_table: np.ndarray) -> None:
        """Host-side work a captured decode step of ``batch_size`` rows needs, run outside
        the graph before its capture and before each replay (the default: none).

        Args:
            seq_lens: ``[batch_size]`` int64, KV length of each row after the step (0 for
                a padding row).
            page_table: ``[batch_size, W]`` int64, each row's pages in order (a padding
                row's entries are not meaningful).
        """
        return None

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata for ``batch``; called once before the layers run."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        kv_stored: bool = False,
        quantize: bool = False,
        sinks: torch.Tensor | None = None,
    ):
        """Store the new keys/values and attend.

        Args:
            q: ``[T, num_heads, head_dim]``.
            k, v: ``[T, num_kv_heads, head_dim]``, written to ``batch.out_slots`` (a ring
                layer's to ``batch.ring_out_slots``: :meth:`ForwardBatch.out_slots_for`).
            layer: layer index into the pool.
            kv_stored: the caller already wrote ``k``/``v`` (rotated) into the pool at
                ``batch.out_slots`` (the model's fused rotary + store kernel); the
                backend then skips its store and reads them from the pool.
            quantize: the output feeds an int8 GEMV (the o projection in GGUF blocks,
                :meth:`~engine.layers.linear.gguf_blocks.QuantLinear.wants_int8`): return
                ``(out, q8)`` (:meth:`attend_quantized`).
            sinks: ``[num_heads]`` logits, one per head, each a column of its own in the
                softmax over the keys with no value (a head may so attend to nothing);
                None: none. Only a backend that ``supports_sinks`` takes them.

        Returns:
            ``[T, num_heads * head_dim]`` in ``q``'s dtype: causal attention of each new
            token over its sequence's cached prefix and the new tokens up to itself.
        """
        if not kv_stored:
            self.pool.store(layer, batch.out_slots_for(layer in self.pool.ring_layers), k, v)
        if sinks is not None:
            if not self.supports_sinks:
                raise ValueError(f"the {type(self).__name__} has no attention sinks; use --attention-backend torch")
            return self.attend(q, layer, batch, sinks=sinks)
        return self.attend_quantized(q, layer, batch) if quantize else self.attend(q, layer, batch)

    def attend_quantized(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, object]:
        """:meth:`attend`, and its output's rows quantized for the int8 GEMV by the
        launch that writes them (:class:`kernels.quant.triton_activations.Q8Activations`) where
        the backend can, else None (the default: the GEMV then quantizes them itself)."""
        return self.attend(q, layer, batch), None

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Attention of ``q`` (``[T, num_heads, head_dim]``) over the pool, whose layer
        ``layer`` already holds the step's keys and values; ``[T, num_heads * head_dim]``
        (see :meth:`forward`)."""
