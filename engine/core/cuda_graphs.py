"""CUDA graphs of the decode step.

A decode step of a small model is hundreds of small kernels; launched one by one each
costs about 22 us of CPU and driver time on an H200, inside a graph under 1 us
(measured; docs/gpu.md and docs/benchmarks.md have the figures). So the decode forward is captured once
per batch size of a ladder (1, 2, 4, 8, then every 8 up to ``--cuda-graph-max-batch``)
and replayed: a batch of ``B`` runs the graph of the next size up, its extra rows padded
(token 0 at position 0, KV written to the null page, context length 0 so attention
reads nothing); batches above the largest size run eagerly.

Inputs live in one persistent device buffer laid out as ``[ids | positions | slots |
seq_lens | prefix_lens | extend_lens | extend_starts | logits rows | state slots | page
table]``, each
section sized for the largest graph; a step writes the host copy with NumPy and uploads
it in one transfer (:class:`engine.core.step_inputs.PinnedStaging`), then replays. The page
table has one row per sequence as wide as the model's context, so it never needs to grow.
Where sliding-window layers keep only their window (:mod:`engine.kvcache.ring`), two
more sections follow: those layers' slots and their page table, built from each
request's ring alike. A hybrid linear-attention model's rows carry their state pool
slots (``states``; padding rows name the null slot 0), which its layers gather and
scatter on the device (:meth:`engine.layers.gated_deltanet.GatedDeltaNet._decode`).

The graphs hold the KV pool's buffer addresses. A live resize gives the pool new
buffers (:meth:`engine.kvcache.pool.KVPool.resize`), so the engine calls
:meth:`DecodeGraphs.invalidate` first, and each size is captured again the first time
it runs after that. Why re-capture rather than stable addresses (CUDA virtual memory):
the resize itself then stays a layer-by-layer copy with no new dependency, and a
re-capture costs one warm-up forward and one capture of a single batch size, paid by
the first decode step after the resize, not by the resize (measured figures in
docs/gpu.md, "Attention backends and CUDA graphs").

A backend whose kernels read a schedule planned on the host (FlashInfer) plans it in
:meth:`engine.layers.attention.base.AttentionBackend.graph_plan`, which runs after the inputs
are written and before the capture or replay.

Each graph also takes the argmax of its logits rows (a few small kernels): a step whose
requests are all greedy and unpenalized reads those ids and launches nothing between
replays (:meth:`engine.core.runner.ModelRunner.run`).

Memory: all sizes share one private memory pool; :meth:`capture_all` returns what the
capture took from the device, which the memory plan charges as "CUDA graph pool".

Under tensor parallel every rank holds its own graphs of the same sizes, the all-reduces
captured inside; ``sync`` (:class:`engine.core.tp_graphs.GraphSync`) keeps the ranks'
replays and re-captures in step and carries rank 0's inputs to the others
(:meth:`replay_shared`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from engine.common.forward_batch import ForwardBatch
from engine.core.step_inputs import PinnedStaging, token_at
from engine.kvcache.ring import ring_row
from engine.layers.attention.base import AttentionBackend
from engine.sampling.device import greedy_tokens

log = logging.getLogger("headroom.engine")


# One capture stream per device for the whole process. cuBLAS keeps a workspace per
# (handle, stream), 32 MiB on Hopper: a fresh stream per capture would leave one such
# workspace per captured size in the graphs' pool (measured: 390 MiB for 11 sizes of a
# 135M model), and a workspace allocated inside a capture pins that pool forever.
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[index]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 8, up to ``max_batch``
    (included). Padding wastes at most 7 rows, or half a batch below 8."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sorted(sizes)


class DecodeGraphs:
    """The decode step's CUDA graphs for one model, backend and KV pool.

    Args:
        model: the ``CausalLM``; ``model(batch, attn)`` must issue no host sync for a
            decode batch whose device tensors are set.
        attn: a backend with ``supports_cuda_graphs``.
        page_size: the pool's.
        max_batch: largest captured batch.
        max_context_tokens: longest context a sequence can reach (the page table width).
        ring: the pool's sliding-window layers keep only their window: the static inputs
            carry their slots and page table too (:mod:`engine.kvcache.ring`).
        states: a hybrid model's: the static inputs carry each row's state pool slot.
    """

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, device: torch.device, *, page_size: int,
                 max_batch: int, max_context_tokens: int, ring: bool = False, states: bool = False) -> None:
        self.model, self.attn, self.device = model, attn, device
        self.page_size = page_size
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = math.ceil(max_context_tokens / page_size)
        g = self.max_batch
        self.ring = ring
        self.states = states
        self._ring_at = self._TABLE * g + g * self.width  # the ring's slots, then its page table
        self._size = self._ring_at + (g + g * self.width if self.ring else 0)
        self._dev = torch.zeros(self._size, dtype=torch.int64, device=device)
        self.staging = PinnedStaging(device, self._size)
        for _ in range(2):  # both pinned buffers start with the constant sections
            self._host_constants(self.staging.host(self._size))
        self._batches = {b: self._static_batch(b) for b in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits here (rows [:b]), so no graph keeps an output block
        # of its own alive in the pool: one [max_batch, V] float32 buffer for all sizes.
        self._logits: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None  # int64 [max_batch]: each row's argmax
        self._pool = None  # the graphs' private memory pool, made at the first capture
        self._failed: set[int] = set()
        # The other ranks of a tensor-parallel group (engine.core.tp_graphs.GraphSync),
        # else None.
        self.sync = None
        self.captures = 0
        self.replays = 0
        self.capture_seconds = 0.0

    # Sections of the packed buffer, in units of max_batch entries.
    _IDS, _POS, _SLOTS, _SEQ, _PREFIX, _EXT, _STARTS, _LOGITS, _STATE, _TABLE = range(10)

    def _section(self, buf, k: int, b: int):
        g = self.max_batch
        return buf[k * g : k * g + b]

    def _host_constants(self, h: np.ndarray) -> None:
        g = self.max_batch
        h[self._EXT * g : (self._EXT + 1) * g] = 1
        h[self._STARTS * g : (self._STARTS + 1) * g] = np.arange(g)
        h[self._LOGITS * g : (self._LOGITS + 1) * g] = np.arange(g)

    def _ring_sections(self, buf, b: int):
        """The ring's slots ``[b]`` and page table ``[b, width]`` of ``buf``."""
        g, w, r = self.max_batch, self.width, self._ring_at
        return buf[r : r + b], buf[r + g : r + g + b * w].reshape(b, w)

    def _static_batch(self, b: int) -> ForwardBatch:
        d, g = self._dev, self.max_batch
        ring_slots, ring_table = self._ring_sections(d, b) if self.ring else (None, None)
        return ForwardBatch(
            is_decode=True,
            input_ids=self._section(d, self._IDS, b),
            positions=self._section(d, self._POS, b),
            out_slots=self._section(d, self._SLOTS, b),
            page_table=d[self._TABLE * g : self._TABLE * g + g * self.width].view(g, self.width)[:b],
            prefix_lens=torch.zeros(b, dtype=torch.int64),
            extend_lens=torch.ones(b, dtype=torch.int64),
            logits_indices=self._section(d, self._LOGITS, b),
            seq_lens_device=self._section(d, self._SEQ, b),
            prefix_lens_device=self._section(d, self._PREFIX, b),
            extend_lens_device=self._section(d, self._EXT, b),
            extend_starts_device=self._section(d, self._STARTS, b),
            ring_out_slots=ring_slots,
            ring_page_table=ring_table,
            state_slots_device=self._section(d, self._STATE, b) if self.states else None,
        )

    def size_for(self, batch_size: int) -> int | None:
        """The captured size a batch of ``batch_size`` runs at, or None (eager)."""
        for s in self.sizes:
            if s >= batch_size:
                return None if s in self._failed else s
        return None

    def graph_for(self, batch_size: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph a batch of ``batch_size`` replays, if it is captured now."""
        size = self.size_for(batch_size)
        return None if size is None else self._graphs.get(size)

    def invalidate(self) -> None:
        """Drop every graph (the KV pool's buffers are about to move); sizes are captured
        again on their next use."""
        self._graphs.clear()
        self._logits = self._tokens = None
        self._failed.clear()
        # With no graph left the old pool is released (its memory goes back with the
        # resize's empty_cache); a capture must not name it again.
        self._pool = None

    # -- filling -------------------------------------------------------------------------

    def _fill(self, items: Sequence, padded: int) -> None:
        """Write the decode inputs of ``items`` into a host buffer and upload the part the
        graph of ``padded`` rows reads."""
        g, ps, w = self.max_batch, self.page_size, self.width
        h = self.staging.host(self.input_words(padded))
        nb = len(items)
        ids, pos, slots = (self._section(h, k, padded) for k in (self._IDS, self._POS, self._SLOTS))
        seq, prefix = self._section(h, self._SEQ, padded), self._section(h, self._PREFIX, padded)
        table = h[self._TABLE * g : self._TABLE * g + padded * w].reshape(padded, w)
        for b, it in enumerate(items):
            req, p = it.req, it.start
            pages = req.pages
            ids[b] = token_at(req, p)
            pos[b] = p
            slots[b] = pages[p // ps] * ps + p % ps
            table[b, : len(pages)] = pages
        if self.ring:
            ring_slots, ring_table = self._ring_sections(h, padded)
            for b, it in enumerate(items):
                ring, n, p = it.req.ring, len(it.req.pages), it.start
                ring_table[b, :n] = ring_row(ring, n)
                ring_slots[b] = ring_table[b, p // ps] * ps + p % ps
            ring_slots[nb:] = 0  # padding rows write the ring's null page
        if self.states:
            state = self._section(h, self._STATE, padded)
            state[:nb] = [it.req.state_slot for it in items]
            state[nb:] = 0  # padding rows step the null slot
        prefix[:nb] = pos[:nb]
        seq[:nb] = pos[:nb] + 1
        # Padding rows: token 0 at position 0, written to the null page, no context.
        ids[nb:] = pos[nb:] = slots[nb:] = seq[nb:] = prefix[nb:] = 0
        self.staging.upload(h, self._dev)
        self.attn.graph_plan(padded, seq, table)

    def _fill_dummy(self, padded: int) -> None:
        g = self.max_batch
        n = self._TABLE * g + padded * self.width
        h = self.staging.host(self.input_words(padded))
        for k in (self._IDS, self._POS, self._SLOTS, self._PREFIX, self._STATE):
            self._section(h, k, padded)[:] = 0
        self._section(h, self._SEQ, padded)[:] = 1
        h[self._TABLE * g : n] = 0
        if self.ring:
            for part in self._ring_sections(h, padded):
                part[:] = 0
        self.staging.upload(h, self._dev)
        self.attn.graph_plan(padded, self._section(h, self._SEQ, padded), h[self._TABLE * g : n].reshape(padded, -1))

    # -- capture and replay --------------------------------------------------------------

    def _warm_up(self, b: int, stream: torch.cuda.Stream) -> None:
        """One eager decode at size ``b`` on a side stream (torch's recipe): Triton
        compiles and loads its kernels, cuBLAS picks its algorithms and the allocator
        settles before anything is recorded."""
        self._fill_dummy(b)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(self._batches[b], self.attn)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture(self, b: int, *, warm: bool = True) -> None:
        started = time.perf_counter()
        batch = self._batches[b]
        stream = capture_stream(self.device)
        if warm:
            self._warm_up(b, stream)
        self._fill_dummy(b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool(), stream=stream, capture_error_mode="thread_local"):
            logits = self.model(batch, self.attn)
            if self._logits is None:
                # Allocated inside the first (largest) capture, from the graphs' pool.
                self._logits = torch.empty((self.max_batch, logits.shape[1]), dtype=logits.dtype, device=self.device)
            self._logits[:b].copy_(logits)
            if self._tokens is None:
                self._tokens = torch.empty(self.max_batch, dtype=torch.int64, device=self.device)
            # The greedy pick inside the graph: a greedy batch then needs no sampling
            # launch between replays, only the read of these ids.
            self._tokens[:b].copy_(greedy_tokens(self._logits[:b]))
        del logits
        self._graphs[b] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started

    def memory_pool(self):
        """The graphs' private memory pool (made at its first use, again after
        :meth:`invalidate`); the prefill graphs (:mod:`engine.core.prefill_graphs`) share it."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every size (largest first, so smaller ones reuse its pool blocks);
        returns the device bytes the graphs hold (see :meth:`_held_bytes`)."""
        started = time.perf_counter()
        stream = capture_stream(self.device)
        torch.cuda.synchronize(self.device)
        allocated0 = torch.cuda.memory_allocated(self.device)
        for b in reversed(self.sizes):
            self._warm_up(b, stream)
        torch.cuda.synchronize(self.device)
        # What the warm-ups left allocated: the capture stream's cuBLAS workspace.
        workspace = max(torch.cuda.memory_allocated(self.device) - allocated0, 0)
        free0, _ = torch.cuda.mem_get_info(self.device)
        reserved0 = torch.cuda.memory_reserved(self.device)
        for b in reversed(self.sizes):
            self._capture(b, warm=False)
        torch.cuda.synchronize(self.device)
        free1, _ = torch.cuda.mem_get_info(self.device)
        # Driver memory outside the allocator (graph executables): the drop in free
        # memory not explained by the allocator's own change. Each capture empties the
        # allocator's cache first (torch.cuda.graph does), so reserved memory may fall.
        driver = max((free0 - free1) - (torch.cuda.memory_reserved(self.device) - reserved0), 0)
        pool = self._pool_bytes(fallback=torch.cuda.memory_reserved(self.device) - reserved0)
        taken = pool + workspace + driver + self._dev.nbytes
        log.info("CUDA graphs: captured decode at batch sizes %s in %.2f s, %.1f MiB (graph pool %.1f MiB, "
                 "capture stream workspace %.1f MiB, graph executables %.1f MiB, inputs %.1f MiB)",
                 ",".join(map(str, self.sizes)), time.perf_counter() - started, taken / 2**20, pool / 2**20,
                 workspace / 2**20, driver / 2**20, self._dev.nbytes / 2**20)
        return taken

    def _pool_bytes(self, fallback: int) -> int:
        """Bytes of the allocator segments that belong to the graphs' private pool (from
        the allocator's snapshot), or ``fallback`` where the snapshot does not say."""
        try:
            snapshot = torch.cuda.memory_snapshot()
        except RuntimeError:
            return max(fallback, 0)
        want = tuple(self._pool)
        found = [seg for seg in snapshot if tuple(seg.get("segment_pool_id", ())) == want]
        if not found:
            return max(fallback, 0)
        return sum(int(seg["total_size"]) for seg in found)

    def run(self, items: Sequence) -> torch.Tensor | None:
        """Replay the decode step for ``items`` (one token each); returns ``[B, V]`` logits
        (a view of the graph's output, valid until the next replay), or None when this
        batch must run eagerly (too large, or its capture ran out of memory).

        Raises:
            torch.OutOfMemoryError: never from the replay itself; a capture that runs
                out of memory is logged and that size runs eagerly until the next
                :meth:`invalidate`.
        """
        padded = self.size_for(len(items))
        if padded is None:
            return None
        words = self.input_words(padded)
        if self.sync is not None:
            self.sync.announce(padded, words)
        if not self._ensure(padded):
            return None
        self._fill(items, padded)
        if self.sync is not None:
            self.sync.share(self._dev[:words])
        self._graphs[padded].replay()
        self.replays += 1
        return self._logits[: len(items)]

    def input_words(self, padded: int) -> int:
        """How many int64 words of the input buffer a replay of ``padded`` rows reads
        (every section, the page table's first ``padded`` rows; with a ring, up to its
        page table's first ``padded`` rows)."""
        if self.ring:
            return self._ring_at + self.max_batch + padded * self.width
        return self._TABLE * self.max_batch + padded * self.width

    def _ensure(self, padded: int) -> bool:
        """Capture ``padded`` if it is not captured now; False when that ran out of memory
        (on any rank of a group: they agree), and the size runs eagerly until the next
        :meth:`invalidate`."""
        if padded in self._graphs:
            return True
        ok = True
        try:
            with torch.inference_mode():
                self._capture(padded)
        except torch.OutOfMemoryError:
            ok = False
        if self.sync is not None:
            ok = self.sync.agree(ok)
        if not ok:
            self._failed.add(padded)
            self._graphs.pop(padded, None)
            log.warning("CUDA graphs: no memory to capture batch size %d; it runs eagerly until the next "
                        "KV pool resize", padded)
            return False
        log.info("CUDA graphs: re-captured decode at batch size %d (%d captures, %.2f s in all)", padded,
                 self.captures, self.capture_seconds)
        return True

    def replay_shared(self, padded: int, words: int) -> None:
        """A follower's replay of rank 0's step (see :mod:`engine.core.tp_graphs`):
        capture ``padded`` if needed (with rank 0), receive rank 0's ``words`` input
        words into the static buffer, plan the backend where it plans on the host, and
        replay. Nothing comes out: rank 0 samples."""
        assert self.sync is not None
        if not self._ensure(padded):
            return
        inputs = self._dev[:words]
        self.sync.share(inputs)
        if type(self.attn).graph_plan is not AttentionBackend.graph_plan:
            h = inputs.cpu().numpy()
            g = self.max_batch
            self.attn.graph_plan(padded, self._section(h, self._SEQ, padded),
                                 h[self._TABLE * g : self._TABLE * g + padded * self.width].reshape(padded, self.width))
        self._graphs[padded].replay()
        self.replays += 1

    def greedy_tokens(self, batch_size: int) -> torch.Tensor:
        """``int64 [batch_size]`` on the device: the argmax of each row of the last
        replay's logits (``-1`` for a row with NaN / infinite logits), as
        :func:`engine.sampling.device.greedy_tokens` gives; valid until the next replay."""
        assert self._tokens is not None
        return self._tokens[:batch_size]
