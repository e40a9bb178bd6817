"""CUDA graphs of a one-sequence prefill chunk.

A short prompt's prefill is as many kernels as a decode step, each launched from Python:
on an H200, one prompt of 128 tokens through an 8B-shape Q4_K_M model took 9.3 ms of
wall time for 3.4 ms of kernels on its first 8 layers (``python -m engine.bench.quant
--layers 8 --profile-prefill 128``; replayed, 3.55 ms): the host's launches, not the
GPU, bound it. So, as the decode step (:mod:`engine.core.cuda_graphs`), the forward of
one sequence's extend of up to ``--prefill-graph-tokens`` tokens is captured once per
size of a ladder (16, 32, 64, ... tokens) and replayed: a chunk of ``T`` tokens runs the
graph of the next size up.

Padding: the chunk's real tokens come first; the padding rows after them take token 0 at
position 0 and write their key and value to the null page. The attention kernel's grid
covers the padded size (``max_extend``), but each sequence's extend length is read on
the device, so only the real rows are attended (causally: a real row never sees a
padding row) and the logits row is the last real token's. Rows are independent
everywhere else in a dense model (norms, projections, the MLP), so padding rows never
reach a real row; that is why only dense models take these graphs (a mixture of experts'
router would route padding rows too, and a hybrid model's state kernels read the
lengths on the host). Models with sliding-window, soft-capped or sink layers prefill
eagerly too: on an H100 Gemma 3's graphs of 32 and 64 tokens hit a device-side assert
(those of 16 did not, and its decode graphs equal transformers), cause not yet found.

What takes a graph: one sequence, no scored prompt (prompt logprobs want every row's
logits), at most the largest size, on a backend with ``supports_cuda_graphs`` whose
graphs need no plan made on the host before each replay
(:meth:`engine.layers.attention.base.AttentionBackend.graph_plan` not overridden, as
FlashInfer's is), and a model whose forward reads nothing back from the device
(:meth:`PrefillGraphs.capturable`). Any other step runs eagerly. Inputs live in one
persistent device buffer laid out as ``[ids | positions | slots | seq_len, prefix_len,
extend_len, extend_start, logits row | page table row]`` for the largest size; where
sliding-window layers keep only their window (:mod:`engine.kvcache.ring`), their slots
and page table row follow.

Memory: the graphs share the decode graphs' private pool when given it (one forward's
activations at a time, reused across sizes: captured largest first), and
:meth:`PrefillGraphs.capture_all` returns what their capture took from the device, which
the memory plan charges with the decode graphs' (its "CUDA graph pool" line).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.common.forward_batch import ForwardBatch
from engine.core.cuda_graphs import capture_stream
from engine.core.step_inputs import PinnedStaging
from engine.kvcache.ring import ring_row
from engine.layers.attention.base import AttentionBackend

log = logging.getLogger("headroom.engine")

SMALLEST = 16


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The captured chunk sizes: powers of two from 16 below ``max_tokens``, then
    ``max_tokens`` itself; none for ``max_tokens`` 0. Padding wastes under half a chunk."""
    if max_tokens <= 0:
        return []
    sizes = []
    size = SMALLEST
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


def graph_size_for(items: Sequence, sizes: Sequence[int]) -> int | None:
    """The captured size a step of ``items`` (``StepItem``s) replays, or None when it runs
    eagerly: more than one sequence, a scored chunk, or more tokens than the largest size."""
    if len(items) != 1 or items[0].scores:
        return None
    tokens = items[0].num_tokens
    return next((s for s in sizes if s >= tokens), None)


def backend_plans_on_host(backend: AttentionBackend | type[AttentionBackend]) -> bool:
    """Whether ``backend`` (an attention backend or its class) overrides
    :meth:`~engine.layers.attention.base.AttentionBackend.graph_plan`: its decode graphs
    need a plan made on the host before each replay, which the prefill graphs do not
    make, so its prefill runs eagerly (FlashInfer's)."""
    cls = backend if isinstance(backend, type) else type(backend)
    return cls.graph_plan is not AttentionBackend.graph_plan


def write_inputs(h: np.ndarray, item, padded: int, max_tokens: int, page_size: int, ring_width: int = 0) -> None:
    """Fill ``h``, int64 laid out as :class:`PrefillGraphs`'s input buffer for chunks of up
    to ``max_tokens`` (``[ids | positions | slots]`` of ``max_tokens`` each, then
    ``seq_len, prefix_len, extend_len, extend_start, logits row``, then the page table
    row), with ``item``'s chunk (a ``StepItem``: ``req.all_ids[start:start +
    num_tokens]`` at positions ``start...``, each written at ``page * page_size +
    offset``) padded to ``padded`` rows (token 0 at position 0, slot 0: the null page).
    ``ring_width``: the page table row is that wide, and the ring's slots
    (``max_tokens``) and page table row (``ring_width``) follow it, from ``req.ring``
    (:mod:`engine.kvcache.ring`); 0: no ring, the row takes the rest of ``h``."""
    t, ps, meta = max_tokens, page_size, 3 * max_tokens
    req, start, k = item.req, item.start, item.num_tokens
    if ring_width:
        r = meta + 5 + ring_width
        ring_slots, ring_table = h[r : r + t], h[r + t : r + t + ring_width]
        ring, n = req.ring, len(req.pages)
        ring_table[:n] = ring_row(ring, n)
        ring_table[n:] = 0
        ring_slots[:k] = ring_table[np.arange(start, start + k) // ps] * ps + np.arange(start, start + k) % ps
        ring_slots[k:] = 0  # padding rows write the ring's null page
        h = h[:r]
    ids, pos, slots = h[:padded], h[t : t + padded], h[2 * t : 2 * t + padded]
    ids[:k] = req.all_ids[start : start + k]
    pos[:k] = np.arange(start, start + k)
    table = h[meta + 5 :]
    pages = req.pages
    table[: len(pages)] = pages
    table[len(pages) :] = 0
    slots[:k] = table[pos[:k] // ps] * ps + pos[:k] % ps
    ids[k:] = pos[k:] = slots[k:] = 0
    h[meta : meta + 5] = (start + k, start, k, 0, k - 1)


class PrefillGraphs:
    """The one-sequence prefill's CUDA graphs for one model, backend and KV pool.

    Args:
        model: a dense ``CausalLM`` whose ``model(batch, attn)`` issues no host sync for
            an extend batch whose device tensors are set.
        attn: a backend with ``supports_cuda_graphs`` that plans nothing on the host.
        device: the CUDA device.
        page_size: the pool's.
        max_tokens: largest captured chunk (tokens).
        max_context_tokens: longest context a sequence can reach (the page table width).
        shared_pool: returns the graph memory pool to capture into (the decode graphs'
            :meth:`~engine.core.cuda_graphs.DecodeGraphs.memory_pool`, so one forward's
            activations serve both); None: a pool of their own.
    """

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, device: torch.device, *, page_size: int,
                 max_tokens: int, max_context_tokens: int, shared_pool: Callable[[], object] | None = None,
                 ring: bool = False) -> None:
        if backend_plans_on_host(attn) or not attn.supports_cuda_graphs:
            raise ValueError(f"{type(attn).__name__} cannot replay a captured prefill")
        self.model, self.attn, self.device = model, attn, device
        self.page_size = page_size
        self.sizes = prefill_graph_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.width = math.ceil(max_context_tokens / page_size)
        t = self.max_tokens
        self._meta = 3 * t  # seq_len, prefix_len, extend_len, extend_start, logits row
        self._table = self._meta + 5
        self.ring = ring
        self._ring_at = self._table + self.width  # the ring's slots, then its page table row
        self._size = self._ring_at + (t + self.width if ring else 0)
        self._dev = torch.zeros(self._size, dtype=torch.int64, device=device)
        self.staging = PinnedStaging(device, self._size)
        self._batches = {s: self._static_batch(s) for s in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # float32 [1, V]: every graph writes its row here
        self._shared_pool = shared_pool
        self._pool = None  # a pool of their own, where none is shared
        self._failed = False  # the re-capture after a resize ran out of memory (eager until invalidate)
        self.captures = 0
        self.replays = 0

    def _static_batch(self, size: int) -> ForwardBatch:
        d, t, m, r = self._dev, self.max_tokens, self._meta, self._ring_at
        return ForwardBatch(
            is_decode=False,
            input_ids=d[:size],
            positions=d[t : t + size],
            out_slots=d[2 * t : 2 * t + size],
            page_table=d[self._table : r].view(1, self.width),
            prefix_lens=torch.zeros(1, dtype=torch.int64),
            # The padded size on the host: the attention kernel's grid covers it (prepare).
            extend_lens=torch.tensor([size], dtype=torch.int64),
            logits_indices=d[m + 4 : m + 5],
            seq_lens_device=d[m : m + 1],
            prefix_lens_device=d[m + 1 : m + 2],
            extend_lens_device=d[m + 2 : m + 3],
            extend_starts_device=d[m + 3 : m + 4],
            ring_out_slots=d[r : r + size] if self.ring else None,
            ring_page_table=d[r + t : r + t + self.width].view(1, self.width) if self.ring else None,
        )

    def size_for(self, items: Sequence) -> int | None:
        """The captured size ``items`` replay, or None (eager): see :func:`graph_size_for`,
        and none while the re-capture after a resize has run out of memory."""
        return None if self._failed else graph_size_for(items, self.sizes)

    def invalidate(self) -> None:
        """Drop every graph (the KV pool's buffers are about to move); sizes are captured
        again on their next use."""
        self._graphs.clear()
        self._logits = None
        self._failed = False
        self._pool = None

    # -- filling -------------------------------------------------------------------------

    def _fill(self, item, padded: int) -> None:
        """Write one chunk's inputs (``item``: a ``StepItem``) for the graph of ``padded``
        tokens and upload them in one copy."""
        h = self.staging.host(self._size)
        write_inputs(h, item, padded, self.max_tokens, self.page_size, self.width if self.ring else 0)
        self.staging.upload(h, self._dev)

    def _fill_dummy(self, padded: int) -> None:
        """Inputs for a warm-up or capture: ``padded`` tokens of a fresh sequence, every
        key and value written to the null page."""
        t, m = self.max_tokens, self._meta
        h = self.staging.host(self._size)
        for k in range(3):
            h[k * t : k * t + padded] = 0
        h[t : t + padded] = range(padded)
        h[self._table : self._size] = 0
        h[m : m + 5] = (padded, 0, padded, 0, padded - 1)
        self.staging.upload(h, self._dev)

    # -- capture and replay --------------------------------------------------------------

    def _warm_up(self, size: int) -> None:
        """One eager forward at ``size`` on the capture stream (torch's recipe): Triton
        compiles, the block GEMMs time their tilings at this size, the allocator settles."""
        stream = capture_stream(self.device)
        self._fill_dummy(size)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(self._batches[size], self.attn)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capturable(self) -> bool:
        """Whether the model's extend can be captured: one more eager forward at the
        largest size (after the warm-ups, so nothing in it times or compiles) with torch
        failing any host sync (``torch.cuda.set_sync_debug_mode``). A forward that syncs
        (a ``.item()``, a tensor read back) is found here, before any capture: a capture
        that fails half-way leaves its stream and memory pool in use. Logs why not."""
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._warm_up(self.max_tokens)
        except RuntimeError as exc:
            if "synchronizing" not in str(exc):
                raise
            log.warning("CUDA graphs: this model's prefill reads back from the device (%s); one sequence's "
                        "prefill runs eagerly", str(exc).splitlines()[0])
            return False
        finally:
            torch.cuda.set_sync_debug_mode(before)
        return True

    def _capture(self, size: int) -> None:
        """Record the graph of ``size`` (warmed up before)."""
        stream = capture_stream(self.device)
        self._fill_dummy(size)
        graph = torch.cuda.CUDAGraph()
        if self._shared_pool is not None:
            pool = self._shared_pool()
        else:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            pool = self._pool
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            logits = self.model(self._batches[size], self.attn)
            if self._logits is None:
                self._logits = torch.empty((1, logits.shape[1]), dtype=logits.dtype, device=self.device)
            self._logits.copy_(logits)
        del logits
        self._graphs[size] = graph
        self.captures += 1

    def _capture_sizes(self) -> None:
        """Warm every size up, then capture them largest first (so the smaller ones reuse
        the largest one's pool blocks)."""
        for size in reversed(self.sizes):
            self._warm_up(size)
        for size in reversed(self.sizes):
            self._capture(size)

    @torch.inference_mode()
    def capture_all(self) -> int | None:
        """Warm every size up, check the forward syncs nothing (:meth:`capturable`), then
        capture every size, largest first. Returns the device bytes the capture took (the
        pool's growth and the graph executables, measured after the warm-ups so their
        kernel modules are not counted here, plus the input buffer), or None where the
        model cannot be captured (nothing was captured; its prefill runs eagerly).

        Raises:
            torch.OutOfMemoryError: a warm-up or capture did not fit.
        """
        started = time.perf_counter()
        for size in reversed(self.sizes):
            self._warm_up(size)
        if not self.capturable():
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free0, _ = torch.cuda.mem_get_info(self.device)
        for size in reversed(self.sizes):
            self._capture(size)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free1, _ = torch.cuda.mem_get_info(self.device)
        taken = max(free0 - free1, 0) + self._dev.nbytes
        log.info("CUDA graphs: captured one-sequence prefill at %s tokens in %.2f s, %.1f MiB",
                 ",".join(map(str, self.sizes)), time.perf_counter() - started, taken / 2**20)
        return taken

    def run(self, items: Sequence) -> torch.Tensor | None:
        """Replay the prefill of ``items`` (one ``StepItem``); returns ``[1, V]`` float32
        logits of its last token (a view of the graph's output, valid until the next
        replay), or None when this step runs eagerly (:meth:`size_for`). The first replay
        after :meth:`invalidate` captures every size again, largest first; if that runs
        out of memory (logged), prefills run eagerly until the next :meth:`invalidate`.
        """
        padded = self.size_for(items)
        if padded is None:
            return None
        if not self._graphs:
            try:
                with torch.inference_mode():
                    self._capture_sizes()
            except torch.OutOfMemoryError:
                self._failed = True
                self._graphs.clear()
                log.warning("CUDA graphs: no memory to capture the prefill graphs again; one sequence's "
                            "prefill runs eagerly until the next KV pool resize")
                return None
            log.info("CUDA graphs: re-captured one-sequence prefill at %s tokens", ",".join(map(str, self.sizes)))
        self._fill(items[0], padded)
        self._graphs[padded].replay()
        self.replays += 1
        return self._logits
