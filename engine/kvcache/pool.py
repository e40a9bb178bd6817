"""The paged KV cache pool: one key and one value buffer per layer.

Layout per layer: ``[num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_pages * page_size``; a token's K/V live at slot
``page * page_size + offset``. A pool of llama.cpp's blocks (``--kv-cache-dtype q8_0``
or ``q4_0``) holds each head's row as its blocks' bytes instead (``head_dim / 32 * 34``
or ``* 18``; :mod:`kernels.attention.kv_store`), quantized when stored and dequantized
row by row when read: no scale tensor beside the buffer, so everything below works on
slots alike. Keeping one buffer per layer (not one tensor for all
layers) lets a resize proceed layer by layer without ever holding two whole pools.

Page 0 is the null page: it is never handed out, so padded page tables (0) and padded
slots point at harmless memory.

Live resize (:meth:`KVPool.resize`), and why layer by layer. A desktop GPU's free
memory moves while the engine runs (other applications take and free it), so the pool must
shrink and grow without dropping the requests it holds, and the memory it gives back
must really reach the device, as NVML sees it. Three ways were weighed:

- *Layer by layer* (chosen): for each of the ``2 x num_layers`` buffers, allocate the
  new one, copy the live part (the pages below ``min(old, new)``), drop the old one and,
  on CUDA, empty the allocator's cache so the freed segment goes back to the driver
  (on the CPU only the pages below the allocator's high-water mark are copied: the new
  buffer is a fresh map, resident only where written, so the pages no request wrote stay
  out of memory).
  The peak over the start is one layer's new buffer (``1 / (2 x num_layers)`` of the
  pool), never a second pool. Measured on an H200 with NVML watching:
  28 buffers of 1 GiB halved in 44 ms with the default allocator and 149 ms with
  expandable segments (which the engine uses), and NVML saw the 14 GiB come back at
  once; a 1 GiB replan is a few ms of copying. It needs nothing beyond torch, works on
  every device (the CPU tests run the same code), and every attention backend keeps
  its view of the pool (one contiguous buffer per layer, read from ``k_buffers`` /
  ``v_buffers`` at each step). The cost: a copy of the live part (bandwidth-bound,
  milliseconds per GiB) and a new base pointer per buffer, so anything captured
  against the old addresses (CUDA graphs) must be captured again after a resize.
- *A segmented pool* (the pool as a list of fixed-size segments, dropped or added at
  the top): no copy, but a page's address becomes (segment, offset), which every
  attention kernel and the slot arithmetic would have to learn.
- *CUDA's virtual memory API* (reserve the largest range once, map and unmap 2 MiB
  granules at its top): no copy and a stable base pointer (on an H200: 16 GiB mapped in
  8 ms, the top 8 GiB unmapped in 6 ms, NVML saw it return). It is CUDA-only and needs
  ``cuda.bindings`` and cupy to view the mapping as a tensor. The engine's decode CUDA
  graphs are instead dropped before a resize and captured again on next use
  (:mod:`engine.core.cuda_graphs`): measured on an H200, a 1 GiB shrink during decode took
  15 ms and the grow 14 ms, the re-captures milliseconds, so the dependency is not
  worth it.

A resize runs between steps (the engine is single-threaded); when shrinking, only pages
below the new size may hold live keys and values: the engine moves them there first
(:meth:`copy_pages`, then ``Engine.resize_kv_pool``).
"""

from __future__ import annotations

import itertools
import math
import mmap
import sys
from collections.abc import Callable, Sequence

import torch

from engine.common import progress
from engine.memory.kv_fit import usable_pages
from kernels.attention.kv_formats import KV_CACHE_DTYPES
from kernels.attention.kv_store import (
    BLOCK_KV_DTYPES,
    FP8_KV_DTYPE,
    is_fp8,
    kv_bytes,
    kv_row_width,
    scatter_kv,
)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``--kv-cache-dtype``: ``auto`` is the model's
    dtype, ``f16`` two bytes a value (float16 for a float32 model, the CPU's; a 16-bit
    model's own dtype, so its attention reads what it always reads), ``fp8`` is ``float8_e4m3fn`` with a per-tensor scale of 1.0, one byte per
    element; ``q8_0`` and ``q4_0`` are llama.cpp's blocks of 32 values with a float16
    scale, stored as bytes whose dtype names the format (``int8``, ``uint8``;
    :mod:`kernels.attention.kv_store`).

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "f16":
        return torch.float16 if model_dtype.itemsize > 2 else model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    if kv_cache_dtype in BLOCK_KV_DTYPES:
        return BLOCK_KV_DTYPES[kv_cache_dtype]
    raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """Zeroed memory of ``nbytes``, private where the platform says so: Python's default
    anonymous map is shared, whose pages ``MADV_DONTNEED`` only unmaps (they come back
    with their contents), where a private one's are freed (:meth:`KVPool.release_memory`)."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


class KVPool:
    """Key/value buffers for ``num_layers`` layers.

    Args:
        num_layers: decoder layers.
        num_pages: pages in the pool, the null page included (so ``num_pages - 1`` are
            usable). Must be at least 2.
        page_size: tokens per page.
        num_kv_heads, head_dim: per-token K/V shape.
        dtype, device: of the buffers (the storage dtype: the model's,
            ``float8_e4m3fn`` for an FP8 KV cache, or a block format's, see
            :func:`kv_storage_dtype`).
        compute_dtype: what keys and values are written as and read back as (the
            model's dtype); defaults to ``dtype``.
        ring_layers: layers whose buffers hold ``ring_pages`` pages of the sliding
            layers' ring pool instead (:mod:`engine.kvcache.ring`); empty: none.
        ring_pages: the ring pool's pages, the null page included.

    Raises:
        ValueError: ``num_pages < 2`` or ``page_size < 1``; ring layers with
            ``ring_pages < 2``, out of range, or every layer a ring layer.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
        ring_layers: Sequence[int] = (),
        ring_pages: int = 0,
    ) -> None:
        ring = frozenset(ring_layers)
        if ring and (ring_pages < 2 or not ring <= set(range(num_layers)) or len(ring) == num_layers):
            raise ValueError(f"ring layers {sorted(ring)} of {num_layers} with {ring_pages} ring pages: they must be "
                             f"some of the layers, not all, and the ring pool needs at least 2 pages")
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.row_width = kv_row_width(dtype, head_dim)  # a buffer's last dimension
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        self.device = torch.device(device)
        self.ring_layers = ring
        self.ring_pages = ring_pages if ring else 0
        sizes = [ring_pages if i in ring else num_pages for i in range(num_layers)]
        self.k_buffers = [self._new_buffer(n, zero_from=0) for n in sizes]
        self.v_buffers = [self._new_buffer(n, zero_from=0) for n in sizes]

    @property
    def _paged(self) -> list[int]:
        """The layers that are not ring layers: those whose pages resize."""
        return [i for i in range(len(self.k_buffers)) if i not in self.ring_layers]

    def _paged_buffers(self) -> list[torch.Tensor]:
        """The keys' and values' buffers of the layers that are not ring layers."""
        return [b for i in self._paged for b in (self.k_buffers[i], self.v_buffers[i])]

    def _new_buffer(self, num_pages: int, *, zero_from: int) -> torch.Tensor:
        """One layer's buffer of ``num_pages`` pages; pages from ``zero_from`` on are zeroed
        (those below are about to be overwritten by a copy).

        On the CPU the buffer is a fresh anonymous memory map: the kernel hands its pages
        out zeroed on first touch, so the pool costs resident memory only for the pages
        requests have written (a 1 GiB default pool under a short chat is a few MiB of
        RSS, where writing zeros would make all of it resident at start)."""
        if self.device.type == "cpu":
            shape = (num_pages * self.page_size, self.num_kv_heads, self.row_width)
            nbytes = math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
            raw = torch.frombuffer(_anonymous_map(max(nbytes, 1)), dtype=torch.uint8)[:nbytes]
            return raw.view(self.dtype).view(shape)
        buf = torch.empty((num_pages * self.page_size, self.num_kv_heads, self.row_width), dtype=self.dtype, device=self.device)
        if zero_from < num_pages:
            buf[zero_from * self.page_size :].zero_()
        return buf

    def release_memory(self, pages: Sequence[int]) -> int:
        """Give the memory of ``pages`` (free pages: their contents are dropped) back to the
        operating system, on a CPU pool under Linux (``madvise(MADV_DONTNEED)`` on the
        anonymous maps; a page reads as zeros afterwards and costs memory again when
        written). Only whole OS pages inside a run of pages go. Returns the bytes given
        back (0 elsewhere: a CUDA pool gives memory back by resizing)."""
        if self.device.type != "cpu" or not sys.platform.startswith("linux") or not pages:
            return 0
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        row = self.k_buffers[self._paged[0]][: self.page_size].nbytes  # one page of one layer's buffer
        # Runs of consecutive pages: a page minus its index is constant along a run.
        runs = [(run[0][1], run[-1][1] + 1) for _, group in itertools.groupby(
            enumerate(sorted(set(pages))), key=lambda ip: ip[1] - ip[0]) for run in [list(group)]]
        given = 0
        for buf in self._paged_buffers():
            base, end_of = buf.data_ptr(), buf.data_ptr() + buf.nbytes
            for lo, hi in runs:
                a = base + lo * row
                b = min(base + hi * row, end_of)
                a, b = -(-a // mmap.PAGESIZE) * mmap.PAGESIZE, b // mmap.PAGESIZE * mmap.PAGESIZE
                if b > a and madvise(a, b - a, mmap.MADV_DONTNEED) == 0:
                    given += b - a
        return given

    @staticmethod
    def bytes_per_page(
        *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs over all layers, keys and values."""
        return 2 * num_layers * page_size * num_kv_heads * kv_bytes(dtype, head_dim)

    @property
    def num_pages(self) -> int:
        """Pages in the pool now, the null page included (the ring layers' pool apart). A
        runtime property: resizes change it."""
        return self.k_buffers[self._paged[0] if self.ring_layers else 0].shape[0] // self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer, the ring layers' included."""
        return sum(b.nbytes for b in self.k_buffers) + sum(b.nbytes for b in self.v_buffers)

    @property
    def usable_bytes(self) -> int:
        """Bytes of the KV pool's usable pages (its null page and the ring layers' pool
        apart): the pool as the plan's ``kv_pool_bytes``, ``EngineInfo.kv_cache_bytes``
        and the replan events' ``kv_pool_bytes`` count it; :attr:`nbytes` is the
        buffers'."""
        return usable_pages(self.num_pages) * self.page_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes one page costs over the layers that are not ring layers, keys and
        values: what a resize of one page adds or gives back."""
        return sum(b.nbytes for b in self._paged_buffers()) // self.num_pages

    @property
    def ring_page_bytes(self) -> int:
        """Bytes one ring pool page costs over the ring layers, keys and values (0 without
        ring layers): what a resize of the ring pool by one page adds or gives back."""
        ring = [b for i in self.ring_layers for b in (self.k_buffers[i], self.v_buffers[i])]
        return sum(b.nbytes for b in ring) // self.ring_pages if ring else 0

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' keys and values.

        Args:
            slots: ``[T]`` int64 flat slots.
            k, v: ``[T, num_kv_heads, head_dim]`` in ``compute_dtype`` (cast to the
                storage dtype here: FP8 pages clamp and round, block pages quantize,
                :mod:`kernels.attention.kv_store`).
        """
        scatter_kv(self.k_buffers[layer], slots, k)
        scatter_kv(self.v_buffers[layer], slots, v)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int], *, ring: bool = False) -> None:
        """Copy the keys and values of pages ``src[i]`` to pages ``dst[i]``, in every
        layer but the ring layers (``ring``: in the ring layers only, pages of their
        pool). The two lists must not overlap (a page is read before any is written, per
        buffer, so they could; the engine never asks for it)."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
        if not src:
            return
        ps = self.page_size
        offsets = torch.arange(ps)
        src_slots = (torch.tensor(list(src), dtype=torch.int64)[:, None] * ps + offsets).reshape(-1).to(self.device)
        dst_slots = (torch.tensor(list(dst), dtype=torch.int64)[:, None] * ps + offsets).reshape(-1).to(self.device)
        buffers = [b for i in sorted(self.ring_layers) for b in (self.k_buffers[i], self.v_buffers[i])] if ring \
            else self._paged_buffers()
        for buf in buffers:
            raw = buf.view(torch.uint8) if is_fp8(buf.dtype) else buf  # no fp8 index ops on the CPU
            raw.index_copy_(0, dst_slots, raw.index_select(0, src_slots))

    def resize(self, num_pages: int, *, written_pages: int | None = None,
               after_buffer: Callable[[], None] | None = None) -> None:
        """Change the pool to ``num_pages`` pages (the null page included), layer by
        layer: allocate one new buffer, copy the pages below ``min(old, new)``, drop the
        old buffer and, on CUDA, give the freed memory back to the device before the next
        buffer (see the module docstring). Pages added by growing are zeroed. Each buffer
        done advances the work counter (:mod:`engine.common.progress`), so the service's
        watchdog sees a long resize move on.

        On the CPU a new buffer is a fresh anonymous map, resident only where written, and
        only the kept pages below ``written_pages`` are copied (the allocator's
        :attr:`~engine.kvcache.allocator.PageAllocator.high_water`: the pages above it were
        never written and read as zeros in the new buffer as in the old): a resize costs
        resident memory for the pages that hold data, not for the pool's size. None, and
        on CUDA always, copies every kept page.

        When shrinking, the caller guarantees that no page ``>= num_pages`` holds live
        keys and values.

        Args:
            after_buffer: called after each buffer's copy (the engine's test-only slow
                resize fault, :mod:`engine.common.faults`); None: nothing.

        Raises:
            ValueError: ``num_pages < 2``.
            torch.OutOfMemoryError: a new buffer did not fit. The pool is then
                consistent at the smaller of the two sizes, contents kept: buffers not
                yet shrunk, or already grown, are narrowed to it (views; their extra
                memory stays held until the next resize).
        """
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self._resize_layers(self._paged, self.num_pages, num_pages, written_pages, after_buffer)

    def resize_ring(self, ring_pages: int, *, written_pages: int | None = None,
                    after_buffer: Callable[[], None] | None = None) -> None:
        """Change the ring layers' pool to ``ring_pages`` pages (the null page included),
        as :meth:`resize` does the others' (the caller guarantees that no ring page
        ``>= ring_pages`` holds live keys and values when shrinking; ``written_pages``
        is the ring allocator's high-water mark).

        Raises:
            ValueError: no ring layers, or ``ring_pages < 2``.
            torch.OutOfMemoryError: as :meth:`resize`; ``ring_pages`` is then the smaller
                of the two sizes.
        """
        if not self.ring_layers or ring_pages < 2:
            raise ValueError(f"a ring pool of {ring_pages} pages: it needs ring layers and at least 2 pages "
                             "(one is the null page)")
        old, self.ring_pages = self.ring_pages, min(self.ring_pages, ring_pages)
        self._resize_layers(sorted(self.ring_layers), old, ring_pages, written_pages, after_buffer)
        self.ring_pages = ring_pages

    def _resize_layers(self, layers: list[int], old: int, num_pages: int, written_pages: int | None,
                       after_buffer: Callable[[], None] | None) -> None:
        """Resize the buffers of ``layers`` from ``old`` to ``num_pages`` pages, layer by
        layer (:meth:`resize`)."""
        if num_pages == old:
            return
        keep = min(old, num_pages) * self.page_size
        on_cuda = self.device.type == "cuda"
        # On the CPU the new map reads as zeros: pages never written need no copy.
        copied = keep if on_cuda or written_pages is None else min(keep, max(written_pages, 1) * self.page_size)
        try:
            for buffers in (self.k_buffers, self.v_buffers):
                for i in layers:
                    new = self._new_buffer(num_pages, zero_from=min(old, num_pages))
                    new[:copied].copy_(buffers[i][:copied])
                    buffers[i] = new  # the old buffer's last reference goes here
                    del new
                    if on_cuda:
                        torch.cuda.empty_cache()
                    progress.advance()
                    if after_buffer is not None:
                        after_buffer()
        except torch.OutOfMemoryError:
            for buffers in (self.k_buffers, self.v_buffers):
                for i in layers:
                    buffers[i] = buffers[i][:keep]
            raise
