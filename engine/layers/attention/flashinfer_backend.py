"""Paged attention through FlashInfer's wrappers (``pip install flashinfer-python``).

The pool's per-layer buffers ``[num_slots, H_kv, D]`` are FlashInfer's ``NHD`` paged
layout viewed as ``[num_pages, page_size, H_kv, D]``, keys and values as a pair, so no
copy. A decode step runs ``BatchDecodeWithPagedKVCacheWrapper``, any other step
``BatchPrefillWithPagedKVCacheWrapper`` with the causal mask aligned to the end of each
sequence (the cached prefix is visible to every new token). Both are planned once per
step from host-side page lists (:meth:`prepare`) and run per layer.

CUDA graphs: a wrapper's plan is host work (it splits the KV into chunks per sequence
and uploads that schedule), so it cannot sit inside a captured graph. FlashInfer's
CUDA-graph mode keeps a decode wrapper's page lists in fixed device buffers and its
schedule at fixed offsets of its workspace, one wrapper per captured batch size; the
graph captures only the kernels, and :meth:`graph_plan` re-plans that wrapper on the
host before its capture and before every replay
(:class:`engine.core.cuda_graphs.DecodeGraphs` calls it). The graph wrappers share one set
of page-list buffers (sized for ``max_batch`` rows of the widest page table) and one
integer workspace: one graph runs at a time, and each replay is planned right before
it.

FlashInfer compiles its kernels on first use with the CUDA toolkit (nvcc); the first
step of each kind logs how long that took, since it can be a minute on a cold cache.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend

log = logging.getLogger("headroom.engine")

# FlashInfer's own examples and engines size the float workspace at 128 MiB; the split-K
# partials of a large batch live there.
FLOAT_WORKSPACE_BYTES = 128 << 20
# Each FlashInfer wrapper allocates an integer workspace of this size for its schedule
# (flashinfer/decode.py and prefill.py, 0.7.x); this backend keeps two eager wrappers.
INT_WORKSPACE_BYTES = 8 << 20


def paged_kv_csr(seq_lens: np.ndarray, page_table: np.ndarray, page_size: int):
    """FlashInfer's page lists of a batch: ``(indptr [B+1], indices [sum pages],
    last_page_len [B])``, int32 NumPy arrays, from ``seq_lens`` (``[B]``, tokens in the
    KV cache after the step) and ``page_table`` (``[B, W]``, each sequence's pages in
    order). A sequence of length 0 (a CUDA graph's padding row) gets one page, the
    null page 0, with one entry: FlashInfer's kernels take at least
    one entry per sequence, and that row's output is never read.

    Raises:
        ValueError: a sequence needs more pages than its table row holds.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    pages = np.maximum(-(-seq_lens // page_size), 1)
    if len(seq_lens) and int(pages.max()) > page_table.shape[1]:
        raise ValueError(f"a sequence of {int(seq_lens.max())} tokens needs {int(pages.max())} pages; "
                         f"the page table holds {page_table.shape[1]}")
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    # Gather (row, column) pairs: O(pages in the batch), not O(B x W).
    rows = np.repeat(np.arange(len(seq_lens)), pages)
    cols = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1], pages)
    indices = page_table[rows, cols].astype(np.int32)
    indices[indptr[:-1][seq_lens == 0]] = 0  # whatever the padding row's table holds
    last = np.maximum(seq_lens - (pages - 1) * page_size, 1).astype(np.int32)
    return indptr, indices, last


class FlashInferAttentionBackend(AttentionBackend):
    """See the module docstring. Needs a CUDA device and ``import flashinfer``."""

    supports_cuda_graphs = True

    @classmethod
    def workspace_size(cls, *, num_heads: int, num_kv_heads: int, head_dim: int, max_batch: int) -> int:
        # The graph wrappers' page lists and shared integer workspace are measured with
        # the rest of the capture ("CUDA graph pool").
        return FLOAT_WORKSPACE_BYTES + 2 * INT_WORKSPACE_BYTES

    def __init__(self, pool, *, num_heads: int, head_dim: int, scale: float, max_batch: int = 64) -> None:
        super().__init__(pool, num_heads=num_heads, head_dim=head_dim, scale=scale, max_batch=max_batch)
        # FlashInfer reads an FP8 (e4m3) pool itself, upcasting with the default scale 1.0
        # our pool is written with (kernels.attention.kv_store).
        if pool.compute_dtype not in (torch.float16, torch.bfloat16) or pool.dtype not in (
                torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"--attention-backend flashinfer runs float16 and bfloat16 models with a KV cache in "
                             f"their dtype or FP8, not {pool.compute_dtype} with {pool.dtype}; "
                             "use --dtype bfloat16 or --attention-backend triton")
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        group = num_heads // pool.num_kv_heads
        # The CUDA-core decode kernels are instantiated for these group sizes; others go
        # through the tensor-core (prefill) path.
        self._tensor_core_decode = group not in (1, 2, 4, 8)
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._tensor_core_decode)
        self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._first_use = {"decode", "prefill"}
        self._wrapper = self._decode_wrapper
        self._kind = "decode"
        self._plan_s = 0.0
        # CUDA-graph mode (graph_plan): one wrapper per captured batch size over shared buffers.
        self._graph_wrappers: dict = {}
        self._graph_buffers: tuple[torch.Tensor, ...] | None = None

    def _plan_kwargs(self) -> dict:
        return dict(q_data_type=self.pool.compute_dtype, kv_data_type=self.pool.dtype, sm_scale=self.scale)

    def prepare(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        if torch.cuda.is_current_stream_capturing():
            # Inside a decode graph's capture: graph_plan already planned this size's
            # wrapper on the host; only its kernels are recorded.
            if batch.batch_size not in self._graph_wrappers:
                raise RuntimeError(f"flashinfer: no graph_plan for a captured decode of batch {batch.batch_size}")
            self._kind, self._wrapper = "decode", self._graph_wrappers[batch.batch_size]
            return
        table = batch.page_table_cpu if batch.page_table_cpu is not None else batch.page_table.cpu()
        indptr, indices, last = paged_kv_csr(batch.seq_lens.numpy(), table.numpy(), ps)
        device = self.pool.device
        kv_heads, dim = self.pool.num_kv_heads, self.head_dim
        started = time.perf_counter()
        if int(batch.extend_lens.max()) == 1:
            self._kind, self._wrapper = "decode", self._decode_wrapper
            self._wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(device), torch.from_numpy(last),
                               self.num_heads, kv_heads, dim, ps, **self._plan_kwargs())
        else:
            self._kind, self._wrapper = "prefill", self._prefill_wrapper
            qo = np.zeros(batch.batch_size + 1, dtype=np.int32)
            np.cumsum(batch.extend_lens.numpy(), out=qo[1:])
            self._wrapper.plan(torch.from_numpy(qo), torch.from_numpy(indptr), torch.from_numpy(indices).to(device),
                               torch.from_numpy(last), self.num_heads, kv_heads, dim, ps, causal=True,
                               **self._plan_kwargs())
        self._plan_s = time.perf_counter() - started

    def graph_plan(self, batch_size: int, seq_lens: np.ndarray, page_table: np.ndarray) -> None:
        """Plan the CUDA-graph wrapper of ``batch_size`` rows for a decode step of these
        sequences (``seq_lens`` ``[batch_size]``, KV length after the step, 0 for a
        padding row; ``page_table`` ``[batch_size, W]``); host work plus small uploads
        into the wrapper's fixed buffers, run outside the capture, before it and before
        each replay. The first call for a size builds its wrapper."""
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            wrapper = self._graph_wrapper(batch_size, page_table.shape[1])
        indptr, indices, last = paged_kv_csr(seq_lens, page_table, self.pool.page_size)
        started = time.perf_counter()
        wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), self.num_heads,
                     self.pool.num_kv_heads, self.head_dim, self.pool.page_size, **self._plan_kwargs())
        if "decode" in self._first_use:
            # The plan loads (and on a cold cache compiles) the decode module.
            self._first_use.discard("decode")
            log.info("flashinfer: first decode step (planned for a CUDA graph) took %.1f s: its kernels are "
                     "compiled on first use and cached for later runs", time.perf_counter() - started)

    def _graph_wrapper(self, batch_size: int, width: int):
        if batch_size > self.max_batch:
            raise ValueError(f"a captured decode of {batch_size} rows exceeds this backend's max_batch {self.max_batch}")
        device = self.pool.device
        if self._graph_buffers is None or self._graph_buffers[1].numel() < self.max_batch * width:
            if self._graph_wrappers:
                raise ValueError(f"page tables wider than {width} pages after the first capture")
            self._graph_buffers = (
                torch.zeros(self.max_batch + 1, dtype=torch.int32, device=device),  # indptr
                torch.zeros(self.max_batch * width, dtype=torch.int32, device=device),  # page indices
                torch.ones(self.max_batch, dtype=torch.int32, device=device),  # last page lengths
                torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device),  # shared schedule
            )
        indptr, indices, last, int_workspace = self._graph_buffers
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_core_decode,
            paged_kv_indptr_buffer=indptr[: batch_size + 1], paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last[:batch_size])
        # Its own integer workspace goes back to the allocator; all graph wrappers share one.
        wrapper.reset_workspace_buffer(self._workspace, int_workspace)
        self._graph_wrappers[batch_size] = wrapper
        return wrapper

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        ps = self.pool.page_size
        shape = (-1, ps, self.pool.num_kv_heads, self.head_dim)
        cache = (self.pool.k_buffers[layer].view(shape), self.pool.v_buffers[layer].view(shape))
        # A capture never times: it cannot sync, and the warm-up before it was the first use.
        first = self._kind in self._first_use and not torch.cuda.is_current_stream_capturing()
        started = time.perf_counter()
        out = self._wrapper.run(q.contiguous(), cache)
        if first:
            torch.cuda.synchronize(q.device)
            self._first_use.discard(self._kind)
            log.info("flashinfer: first %s step took %.1f s (plan %.1f s): its kernels are compiled on first "
                     "use and cached for later runs", self._kind, time.perf_counter() - started + self._plan_s,
                     self._plan_s)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
