"""Rank 0 leads, the other ranks follow: one broadcast per step and per KV pool change.

Only rank 0 schedules. Before each forward it broadcasts the step's inputs (the
:class:`engine.common.forward_batch.ForwardBatch` integers, packed in one int64 tensor after a
fixed header: with sliding-window rings, :mod:`engine.kvcache.ring`, the ring's page table
and slots too); before each page copy or resize of the KV pool or of the ring pool (a
relocation, a ring checkpoint saved or restored, a live resize) it broadcasts the same
command, so every rank's pools keep the same pages at the same ids (the page tables of
rank 0 are valid on every rank). A follower runs exactly the collectives rank 0 runs, in
the same order, which is what keeps the group in step.

A decode step that replays a CUDA graph goes another way (:mod:`engine.core.tp_graphs`):
rank 0 sends :data:`~engine.core.tp_commands.OP_REPLAY` with the batch size, then broadcasts its graph's packed
input buffer from the device into every follower's, and each rank replays its own graph.

After a resize every rank reports its pool size (an all-gather); rank 0 checks they agree
and raises otherwise (a rank that failed to resize: the group must restart); the sizes
stay on rank 0's engine as ``rank_pool_pages`` (the ring pool's as ``rank_ring_pages``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine.common.forward_batch import ForwardBatch
from engine.core.tp_commands import (
    HEADER_WORDS,
    OP_COPY_PAGES,
    OP_FORWARD,
    OP_REPLAY,
    OP_RESIZE,
    OP_RESIZE_RING,
    OP_STOP,
    WORD_PAGES,
    WORD_RING,
    send_command,
)
from engine.core.tp_graphs import GraphSync
from engine.memory.kv_fit import usable_pages
from engine.parallel.group import TensorParallel

log = logging.getLogger("headroom.parallel")


class GroupOutOfStep(RuntimeError):
    """The ranks' KV pools disagree after a resize; the group must be restarted."""


def _pack(batch: ForwardBatch) -> torch.Tensor:
    """The step's integers in one int64 tensor on the CPU, in :func:`_sizes`' order."""
    ring = () if batch.ring_page_table is None else (batch.ring_out_slots, batch.ring_page_table)
    return torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in (
        batch.input_ids, batch.positions, batch.out_slots, batch.page_table, batch.prefix_lens,
        batch.extend_lens, batch.logits_indices, *ring)])


def _sizes(values: list[int]) -> list[int]:
    """The parts of an ``OP_FORWARD`` payload, from its header's ``values``: ids,
    positions and slots ``[t]``, the page table ``[b * p]``, prefix and extend lengths
    ``[b]``, the logits rows; with ``ring``, the ring's slots ``[t]`` and page table."""
    t, b, p, n_logits = values[1:5]
    return [t, t, t, b * p, b, b, n_logits] + ([t, b * p] if values[WORD_RING] else [])


def _unpack(values: list[int], payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    b, p = values[2:4]
    ids, pos, slots, table, prefix, extend, logits, *ring = payload.to("cpu").split(_sizes(values))
    table = table.view(b, p)
    on = lambda x: x.to(device)  # noqa: E731
    return ForwardBatch(is_decode=bool(values[5]), input_ids=on(ids), positions=on(pos), out_slots=on(slots),
                        page_table=on(table), prefix_lens=prefix.clone(), extend_lens=extend.clone(),
                        logits_indices=on(logits), page_table_cpu=table.clone(),
                        ring_out_slots=on(ring[0]) if ring else None,
                        ring_page_table=on(ring[1].view(b, p)) if ring else None)


class _LeadingModel:
    """Rank 0's model as the runner calls it: broadcast the step, then run it."""

    def __init__(self, model: Any, tp: TensorParallel) -> None:
        self.model, self.tp = model, tp

    def __call__(self, batch: ForwardBatch, attn: Any) -> torch.Tensor:
        b, p = batch.page_table.shape
        payload = _pack(batch)
        send_command(self.tp, [OP_FORWARD, batch.num_tokens, b, p, int(batch.logits_indices.numel()),
                               int(batch.is_decode), 0, int(batch.ring_page_table is not None)], payload)
        return self.model(batch, attn)


def lead(engine: Any, tp: TensorParallel) -> None:
    """Make rank 0's ``engine`` (an :class:`engine.core.engine.Engine`) broadcast each step
    and each page copy and resize of its KV pool and ring pool to the followers before
    doing it itself."""
    pool = engine.pool
    copy_pages, resize, resize_ring = pool.copy_pages, pool.resize, pool.resize_ring

    def leading_copy_pages(src: Sequence[int], dst: Sequence[int], *, ring: bool = False) -> None:
        if src:
            send_command(tp, _header(OP_COPY_PAGES, len(src), ring=int(ring)),
                         torch.tensor([*src, *dst], dtype=torch.int64))
        copy_pages(src, dst, ring=ring)

    def leading_resize(num_pages: int, **how: Any) -> None:  # how: KVPool.resize's keywords, rank 0's own
        send_command(tp, _header(OP_RESIZE, pages=num_pages))
        try:
            resize(num_pages, **how)
        finally:
            engine.rank_pool_pages = _agree_on_pool(engine, tp)

    def leading_resize_ring(ring_pages: int, **how: Any) -> None:
        send_command(tp, _header(OP_RESIZE_RING, pages=ring_pages))
        try:
            resize_ring(ring_pages, **how)
        finally:
            engine.rank_ring_pages = _agree_on_pool(engine, tp, ring=True)

    # Instance attributes shadow the methods: the engine's replan code stays the same.
    pool.copy_pages, pool.resize, pool.resize_ring = leading_copy_pages, leading_resize, leading_resize_ring
    engine.runner.model = _LeadingModel(engine.runner.model, tp)
    _sync_graphs(engine, tp)


def _sync_graphs(engine: Any, tp: TensorParallel) -> None:
    """Keep this rank's decode graphs (if it captured any) in step with the others'."""
    if engine.runner.graphs is not None:
        engine.runner.graphs.sync = GraphSync(tp)


def stop_followers(tp: TensorParallel) -> None:
    """Tell the followers to leave their loop (an orderly shutdown)."""
    send_command(tp, [OP_STOP])


def _header(op: int, first: int = 0, *, pages: int = 0, ring: int = 0) -> list[int]:
    """A command's header: ``op``, word 1 ``first``, the page count and the ring flag in
    their words (:mod:`engine.core.tp_commands`)."""
    header = [op, first] + [0] * 6
    header[WORD_PAGES], header[WORD_RING] = pages, ring
    return header


def _agree_on_pool(engine: Any, tp: TensorParallel, *, ring: bool = False) -> list[int]:
    """Every rank's KV pool pages (``ring``: its ring pool's), in rank order; rank 0
    raises :class:`GroupOutOfStep` where they differ."""
    mine = engine.pool.ring_pages if ring else engine.pool.num_pages
    what = "ring pool" if ring else "KV pool"
    sizes = tp.gather_int(mine)
    usable = [usable_pages(n) for n in sizes]
    log.info("%s on rank %d: %d pages (every rank: %s)", what, tp.rank, usable_pages(mine), usable)
    if tp.is_leader and len(set(sizes)) != 1:
        raise GroupOutOfStep(f"the ranks' {what}s differ after a resize ({usable} pages); the group restarts")
    return sizes


def follow(engine: Any, tp: TensorParallel) -> None:
    """A follower's loop: receive rank 0's commands and carry them out on this rank's
    model and KV pool, until :data:`~engine.core.tp_commands.OP_STOP`.

    Raises:
        RuntimeError: from ``torch.distributed`` when rank 0 is gone (the collective
            fails); the follower then exits.
    """
    header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=tp.device)
    _sync_graphs(engine, tp)
    while True:
        dist.broadcast(header, 0)
        values = header.tolist()  # one read back of the header, not one per field
        op = values[0]
        if op == OP_STOP:
            return
        if op == OP_FORWARD:
            payload = torch.empty(sum(_sizes(values)), dtype=torch.int64, device=tp.device)
            dist.broadcast(payload, 0)
            with torch.inference_mode():
                engine.model(_unpack(values, payload, engine.device), engine.attn)
        elif op == OP_REPLAY:
            with torch.inference_mode():
                engine.runner.graphs.replay_shared(values[1], values[2])
        elif op == OP_COPY_PAGES:
            n = values[1]
            payload = torch.empty(2 * n, dtype=torch.int64, device=tp.device)
            dist.broadcast(payload, 0)
            moves = payload.tolist()
            engine.pool.copy_pages(moves[:n], moves[n:], ring=bool(values[WORD_RING]))
        elif op in (OP_RESIZE, OP_RESIZE_RING):
            ring = op == OP_RESIZE_RING
            engine.runner.pool_will_move()
            try:
                (engine.pool.resize_ring if ring else engine.pool.resize)(values[WORD_PAGES])
            finally:
                _agree_on_pool(engine, tp, ring=ring)
        else:
            raise RuntimeError(f"unknown command {op} from rank 0")
