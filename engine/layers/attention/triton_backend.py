"""Paged attention with the Triton kernels of :mod:`kernels.attention.triton_kernel`.

One launch per layer covers every sequence of the step: a decode step (one new token
per sequence) runs the split-K decode kernel, any other step the ragged extend kernel
over the cached prefix. :meth:`prepare` reads only host-side shapes and the device
tensors the runner filled, so a decode step can be captured in a CUDA graph.

Workspace: the split-K partials for the largest decode batch, allocated once at
construction and declared to the memory plan (:meth:`workspace_size`).
"""

from __future__ import annotations

import torch

from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend


class TritonAttentionBackend(AttentionBackend):
    """See the module docstring. Needs a CUDA device (or Triton's interpreter on CPU
    tensors, for tests)."""

    supports_cuda_graphs = True
    supports_windows = True  # sliding-window layers read their window only (the kernels' ``window``)
    supports_softcap = True  # scores capped as each tile is scored (the kernels' ``softcap``)
    supports_sinks = True  # a logit per head in each row's softmax (the kernels' ``sinks``)
    kv_block_formats = ("q8_0", "q4_0")  # the kernels dequantize each tile of blocks as they load it

    @classmethod
    def workspace_size(cls, *, num_heads: int, num_kv_heads: int, head_dim: int, max_batch: int) -> int:
        from kernels.attention.triton_kernel import decode_workspace_bytes

        return decode_workspace_bytes(max_batch, num_heads, num_kv_heads, head_dim)

    def __init__(self, pool, *, num_heads: int, head_dim: int, scale: float, max_batch: int = 64) -> None:
        super().__init__(pool, num_heads=num_heads, head_dim=head_dim, scale=scale, max_batch=max_batch)
        from kernels.attention import triton_kernel as attention_triton

        self._kernels = attention_triton
        size = self.workspace_size(num_heads=num_heads, num_kv_heads=pool.num_kv_heads, head_dim=head_dim,
                                   max_batch=max_batch)
        self._workspace = torch.empty(size // 4, dtype=torch.float32, device=pool.device)
        self._decode = True
        self._max_extend = 1

    def prepare(self, batch: ForwardBatch) -> None:
        # extend_lens lives on the CPU: reading it is no device sync.
        self._max_extend = int(batch.extend_lens.max()) if batch.batch_size else 0
        self._decode = self._max_extend == 1 and batch.batch_size <= self.max_batch
        batch.device_meta()

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`AttentionBackend.attend`, with ``sinks`` (``[H]`` logits on the device, or
        None) as :meth:`AttentionBackend.forward` takes them."""
        return self._attend(q, layer, batch, False, sinks)[0]

    def attend_quantized(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, object]:
        """Decode: the split merge quantizes the rows it writes (:func:`kernels.
        attention_triton.paged_decode`'s ``quantize``) where the launch has one."""
        return self._attend(q, layer, batch, True)

    def _attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch, quantize: bool,
                sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        if q.stride(-1) != 1:
            q = q.contiguous()
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        seq_lens, prefix_lens, extend_lens, starts = batch.device_meta()
        ps = self.pool.page_size
        window = self.windows[layer] if self.windows else 0
        page_table = batch.page_table_for(layer in self.pool.ring_layers)
        q8 = None
        if self._decode:
            out = self._kernels.paged_decode(q, k_buf, v_buf, page_table, seq_lens, ps, self.scale,
                                             workspace=self._workspace, quantize=quantize, window=window,
                                             softcap=self.softcap, sinks=sinks)
            if quantize:
                out, q8 = out
        else:
            out = self._kernels.paged_extend(q, k_buf, v_buf, page_table, starts, prefix_lens, extend_lens,
                                             ps, self.scale, max_extend=self._max_extend, window=window,
                                             softcap=self.softcap, sinks=sinks)
        return out.view(q.shape[0], self.num_heads * self.head_dim), q8
