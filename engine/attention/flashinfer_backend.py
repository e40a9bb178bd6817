"""Paged attention through FlashInfer's wrappers (``pip install flashinfer-python``).

The pool's per-layer buffers ``[num_slots, H_kv, D]`` are FlashInfer's ``NHD`` paged
layout viewed as ``[num_pages, page_size, H_kv, D]``, keys and values as a pair, so no
copy. A decode step runs ``BatchDecodeWithPagedKVCacheWrapper``, any other step
``BatchPrefillWithPagedKVCacheWrapper`` with the causal mask aligned to the end of each
sequence (the cached prefix is visible to every new token). Both are planned once per
step from host-side page lists (:meth:`prepare`) and run per layer.

FlashInfer compiles its kernels on first use with the CUDA toolkit (nvcc); the first
step of each kind logs how long that took, since it can be a minute on a cold cache.
Decode steps run eagerly here: the wrappers' plan is host work per step that a captured
graph would have to re-run outside the capture (FlashInfer's CUDA-graph mode), which
this backend does not do yet.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention.base import AttentionBackend, register_backend
from engine.forward_batch import ForwardBatch

log = logging.getLogger("headroom.engine")

# FlashInfer's own examples and engines size the float workspace at 128 MiB; the split-K
# partials of a large batch live there.
FLOAT_WORKSPACE_BYTES = 128 << 20


@register_backend("flashinfer")
class FlashInferAttentionBackend(AttentionBackend):
    """See the module docstring. Needs a CUDA device and ``import flashinfer``."""

    workspace_bytes = FLOAT_WORKSPACE_BYTES

    def __init__(self, pool, *, num_heads: int, head_dim: int, scale: float, max_batch: int = 64) -> None:
        super().__init__(pool, num_heads=num_heads, head_dim=head_dim, scale=scale, max_batch=max_batch)
        if pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"--attention-backend flashinfer runs float16 and bfloat16 KV caches, not {pool.dtype}; "
                             "use --dtype bfloat16 or --attention-backend triton")
        import flashinfer

        self._workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        group = num_heads // pool.num_kv_heads
        # The CUDA-core decode kernels are instantiated for these group sizes; others go
        # through the tensor-core (prefill) path.
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=group not in (1, 2, 4, 8))
        self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._first_use = {"decode", "prefill"}
        self._wrapper = self._decode_wrapper
        self._kind = "decode"

    def prepare(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        seq_lens = batch.seq_lens.numpy()
        pages = -(-seq_lens // ps)
        indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        table = batch.page_table_cpu if batch.page_table_cpu is not None else batch.page_table.cpu()
        table = table.numpy()
        indices = np.concatenate([table[b, :n] for b, n in enumerate(pages)]).astype(np.int32)
        last = (seq_lens - (pages - 1) * ps).astype(np.int32)
        device = self.pool.device
        dtype = self.pool.dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        kv_heads, dim = self.pool.num_kv_heads, self.head_dim
        started = time.perf_counter()
        if int(batch.extend_lens.max()) == 1:
            self._kind, self._wrapper = "decode", self._decode_wrapper
            self._wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(device), torch.from_numpy(last),
                               self.num_heads, kv_heads, dim, ps, **common)
        else:
            self._kind, self._wrapper = "prefill", self._prefill_wrapper
            qo = np.zeros(len(seq_lens) + 1, dtype=np.int32)
            np.cumsum(batch.extend_lens.numpy(), out=qo[1:])
            self._wrapper.plan(torch.from_numpy(qo), torch.from_numpy(indptr), torch.from_numpy(indices).to(device),
                               torch.from_numpy(last), self.num_heads, kv_heads, dim, ps, causal=True, **common)
        self._plan_s = time.perf_counter() - started

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        ps = self.pool.page_size
        shape = (-1, ps, self.pool.num_kv_heads, self.head_dim)
        cache = (self.pool.k_buffers[layer].view(shape), self.pool.v_buffers[layer].view(shape))
        first = self._kind in self._first_use
        started = time.perf_counter()
        out = self._wrapper.run(q.contiguous(), cache)
        if first:
            torch.cuda.synchronize(q.device)
            self._first_use.discard(self._kind)
            log.info("flashinfer: first %s step took %.1f s (plan %.1f s): its kernels are compiled on first "
                     "use and cached for later runs", self._kind, time.perf_counter() - started + self._plan_s,
                     self._plan_s)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
