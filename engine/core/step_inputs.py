"""A step's inputs, from the scheduler's plan to device tensors with one copy.

Every integer a step needs (token ids, positions, KV slots, the logits rows, the
per-sequence lengths and the page table; the sliding layers' ring table and slots where
they keep only their window) is written with NumPy into one pinned host
buffer and copied to one persistent device buffer in a single asynchronous transfer;
the :class:`ForwardBatch` fields are views into it. No tensor is built from a Python
list on this path, and nothing waits for the device: the step's one host sync is the
sampled ids.

Two pinned buffers alternate, each guarded by an event recorded after its copy, so the
host never overwrites a buffer whose previous copy has not run yet (a step that samples
nothing does not sync at all).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.common.forward_batch import ForwardBatch
from engine.kvcache.ring import ring_row
from engine.scheduler.request import Request


def token_at(req: Request, position: int) -> int:
    """Token id at ``position`` of the request's prompt + output, without building the
    concatenated list (``Request.all_ids`` copies both)."""
    n = len(req.prompt_ids)
    return req.prompt_ids[position] if position < n else req.output_ids[position - n]


class PinnedStaging:
    """Pinned host buffers of int64 that upload into a device buffer (see the module
    docstring). On a CPU device there is no copy: :meth:`host` hands out fresh arrays and
    :meth:`upload` returns a tensor over the same memory."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._flip = 0
        if self.on_cuda:
            self._grow_host(capacity)

    def _grow_host(self, capacity: int) -> None:
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._host = [torch.zeros(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._events = [None, None]

    def host(self, n: int) -> np.ndarray:
        """A writable int64 array of ``n`` entries for the next upload (zeroed on the CPU
        path only; the CUDA path hands back the buffer as the last upload from it left
        it)."""
        if not self.on_cuda:
            return np.zeros(n, dtype=np.int64)
        if n > self._host[0].numel():
            self._grow_host(max(n, 2 * self._host[0].numel()))
        self._flip ^= 1
        ev = self._events[self._flip]
        if ev is not None:
            ev.synchronize()  # its previous copy ran long ago, in practice
        return self._host[self._flip].numpy()[:n]

    def upload(self, host: np.ndarray, dest: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``host`` (from :meth:`host`) to ``dest[:len(host)]`` (a device int64 tensor)
        asynchronously; returns that device slice. On the CPU path returns ``host`` as a
        tensor, or, given a ``dest``, copies it there and returns that slice."""
        n = host.shape[0]
        if not self.on_cuda:
            if dest is None:
                return torch.from_numpy(host)
            dest[:n].copy_(torch.from_numpy(host))
            return dest[:n]
        assert dest is not None
        out = dest[:n]
        out.copy_(self._host[self._flip][:n], non_blocking=True)
        ev = self._events[self._flip] or torch.cuda.Event()
        ev.record()
        self._events[self._flip] = ev
        return out


class StepInputs:
    """Builds the :class:`ForwardBatch` of any step (prefill, extend, mixed, decode)."""

    def __init__(self, device: torch.device, page_size: int, ring: bool = False) -> None:
        """``ring``: the pool's sliding-window layers keep only their window, so each
        batch carries their page table and slots, built from ``Request.ring``."""
        self.device = device
        self.page_size = page_size
        self.ring = ring
        self.staging = PinnedStaging(device)
        self._dev = torch.empty(1 << 16, dtype=torch.int64, device=device) if device.type == "cuda" else None

    def build(self, items: Sequence, is_decode: bool) -> ForwardBatch:
        """Flatten the plan's items (``StepItem``: ``req``, ``start``, ``num_tokens``,
        ``samples``) into one ragged batch; see :class:`ForwardBatch` for the fields."""
        ps = self.page_size
        nb = len(items)
        prefix = np.fromiter((it.start for it in items), dtype=np.int64, count=nb)
        ext = np.fromiter((it.num_tokens for it in items), dtype=np.int64, count=nb)
        width = max(len(it.req.pages) for it in items)
        t = int(ext.sum())
        samples = np.fromiter((it.samples for it in items), dtype=bool, count=nb)
        scores = np.fromiter((it.scores for it in items), dtype=bool, count=nb)
        # A scored chunk (a prompt whose logprobs are wanted) takes logits at all its
        # rows; the others at their last row when they sample.
        per_item = np.where(scores, ext, samples.astype(np.int64))
        ns = int(per_item.sum())
        # Sliding-window layers that keep only their window (engine.kvcache.ring): their
        # page table and slots follow the global ones in the same upload.
        ring = self.ring
        n = 3 * t + ns + 4 * nb + nb * width
        end = n + (t + nb * width if ring else 0)
        h = self.staging.host(end)
        ids, pos, slots = h[:t], h[t : 2 * t], h[2 * t : 3 * t]
        logits_rows = h[3 * t : 3 * t + ns]
        meta = h[3 * t + ns : 3 * t + ns + 4 * nb].reshape(4, nb)
        table = h[3 * t + ns + 4 * nb : n].reshape(nb, width)
        table.fill(0)
        at = 0
        for b, it in enumerate(items):
            req, k = it.req, it.num_tokens
            if k == 1:
                ids[at] = token_at(req, it.start)
            else:
                ids[at : at + k] = req.all_ids[it.start : it.start + k]
            table[b, : len(req.pages)] = req.pages
            at += k
        starts = np.cumsum(ext) - ext
        seq = np.repeat(np.arange(nb), ext)
        pos[:] = np.arange(t) - np.repeat(starts, ext) + np.repeat(prefix, ext)
        slots[:] = table[seq, pos // ps] * ps + pos % ps
        sample_rows = None
        if scores.any():
            logits_rows[:] = np.concatenate(
                [np.arange(st, st + e) if sc else np.arange(st + e - 1, st + e) if sm else np.arange(0)
                 for st, e, sc, sm in zip(starts, ext, scores, samples, strict=True)])
            # Where each sampling item's row lies among the logits rows: its chunk's last.
            ends = np.cumsum(per_item)
            sample_rows = torch.from_numpy(ends[samples] - 1)
        else:
            logits_rows[:] = (starts + ext - 1)[samples]
        meta[0], meta[1], meta[2], meta[3] = prefix + ext, prefix, ext, starts
        if ring:
            ring_slots, ring_table = h[n : n + t], h[n + t : end].reshape(nb, width)
            ring_table.fill(0)
            for b, it in enumerate(items):
                ring_table[b, : len(it.req.pages)] = ring_row(it.req.ring, len(it.req.pages))
            ring_slots[:] = ring_table[seq, pos // ps] * ps + pos % ps
        table_cpu = torch.from_numpy(table.copy())
        if self._dev is not None and end > self._dev.numel():
            self._dev = torch.empty(max(end, 2 * self._dev.numel()), dtype=torch.int64, device=self.device)
        d = self.staging.upload(h, self._dev)
        dmeta = d[3 * t + ns : 3 * t + ns + 4 * nb].view(4, nb)
        return ForwardBatch(
            is_decode=is_decode,
            input_ids=d[:t],
            positions=d[t : 2 * t],
            out_slots=d[2 * t : 3 * t],
            page_table=d[3 * t + ns + 4 * nb : n].view(nb, width),
            prefix_lens=torch.from_numpy(prefix),
            extend_lens=torch.from_numpy(ext),
            logits_indices=d[3 * t : 3 * t + ns],
            seq_lens_device=dmeta[0],
            prefix_lens_device=dmeta[1],
            extend_lens_device=dmeta[2],
            extend_starts_device=dmeta[3],
            page_table_cpu=table_cpu,
            sample_rows=sample_rows,
            ring_out_slots=d[n : n + t] if ring else None,
            ring_page_table=d[n + t : end].view(nb, width) if ring else None,
        )
