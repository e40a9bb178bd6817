"""Rank 0 leads, the other ranks follow: one broadcast per step and per KV pool change.

Only rank 0 schedules. Before each forward it broadcasts the step's inputs (the
:class:`engine.common.forward_batch.ForwardBatch` integers, packed in one int64 tensor after a
fixed header); before each relocation or resize of the KV pool it broadcasts the same
command, so every rank's pool keeps the same pages at the same ids (the page tables of
rank 0 are valid on every rank). A follower runs exactly the collectives rank 0 runs, in
the same order, which is what keeps the group in step.

A decode step that replays a CUDA graph goes another way (:mod:`engine.core.tp_graphs`):
rank 0 sends :data:`OP_REPLAY` with the batch size, then broadcasts its graph's packed
input buffer from the device into every follower's, and each rank replays its own graph.

After a resize every rank reports its pool size (an all-gather); rank 0 checks they agree
and raises otherwise (a rank that failed to resize: the group must restart); the sizes
stay on rank 0's engine as ``rank_pool_pages``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine.common.forward_batch import ForwardBatch
from engine.core.tp_graphs import GraphSync
from engine.parallel.group import TensorParallel

log = logging.getLogger("headroom.parallel")

# Header: [op, num_tokens, batch, max_pages, num_logits, is_decode, num_pages or moves, 0].
_HEADER = 8
OP_FORWARD, OP_COPY_PAGES, OP_RESIZE, OP_STOP, OP_REPLAY = 1, 2, 3, 4, 5


class GroupOutOfStep(RuntimeError):
    """The ranks' KV pools disagree after a resize; the group must be restarted."""


def _broadcast(tp: TensorParallel, header: list[int], payload: torch.Tensor | None = None) -> None:
    dist.broadcast(torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=tp.device), 0)
    if payload is not None and payload.numel():
        dist.broadcast(payload.to(tp.device, torch.int64).contiguous(), 0)


def _pack(batch: ForwardBatch) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in (
        batch.input_ids, batch.positions, batch.out_slots, batch.page_table, batch.prefix_lens,
        batch.extend_lens, batch.logits_indices)])


def _unpack(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    t, b, p, n_logits, is_decode = (int(x) for x in header[1:6])
    sizes = [t, t, t, b * p, b, b, n_logits]
    ids, pos, slots, table, prefix, extend, logits = payload.to("cpu").split(sizes)
    table = table.view(b, p)
    on = lambda x: x.to(device)  # noqa: E731
    return ForwardBatch(is_decode=bool(is_decode), input_ids=on(ids), positions=on(pos), out_slots=on(slots),
                        page_table=on(table), prefix_lens=prefix.clone(), extend_lens=extend.clone(),
                        logits_indices=on(logits), page_table_cpu=table.clone())


class _LeadingModel:
    """Rank 0's model as the runner calls it: broadcast the step, then run it."""

    def __init__(self, model: Any, tp: TensorParallel) -> None:
        self.model, self.tp = model, tp

    def __call__(self, batch: ForwardBatch, attn: Any) -> torch.Tensor:
        b, p = batch.page_table.shape
        payload = _pack(batch)
        _broadcast(self.tp, [OP_FORWARD, batch.num_tokens, b, p, int(batch.logits_indices.numel()),
                             int(batch.is_decode)], payload)
        return self.model(batch, attn)


def lead(engine: Any, tp: TensorParallel) -> None:
    """Make rank 0's ``engine`` (an :class:`engine.core.engine.Engine`) broadcast each step
    and each KV pool relocation and resize to the followers before doing it itself."""
    pool = engine.pool
    copy_pages, resize = pool.copy_pages, pool.resize

    def leading_copy_pages(src: Sequence[int], dst: Sequence[int]) -> None:
        if src:
            _broadcast(tp, [OP_COPY_PAGES, len(src)], torch.tensor([*src, *dst], dtype=torch.int64))
        copy_pages(src, dst)

    def leading_resize(num_pages: int) -> None:
        _broadcast(tp, [OP_RESIZE, 0, 0, 0, 0, 0, num_pages])
        try:
            resize(num_pages)
        finally:
            engine.rank_pool_pages = _agree_on_pool(engine, tp)

    # Instance attributes shadow the methods: the engine's replan code stays the same.
    pool.copy_pages, pool.resize = leading_copy_pages, leading_resize
    engine.runner.model = _LeadingModel(engine.runner.model, tp)
    _sync_graphs(engine, tp)


def _sync_graphs(engine: Any, tp: TensorParallel) -> None:
    """Keep this rank's decode graphs (if it captured any) in step with the others'."""
    if engine.runner.graphs is not None:
        engine.runner.graphs.sync = GraphSync(tp)


def stop_followers(tp: TensorParallel) -> None:
    """Tell the followers to leave their loop (an orderly shutdown)."""
    _broadcast(tp, [OP_STOP])


def _agree_on_pool(engine: Any, tp: TensorParallel) -> list[int]:
    sizes = tp.gather_int(engine.pool.num_pages)
    log.info("KV pool on rank %d: %d pages (every rank: %s)", tp.rank, engine.pool.num_pages, sizes)
    if tp.is_leader and len(set(sizes)) != 1:
        raise GroupOutOfStep(f"the ranks' KV pools differ after a resize ({sizes} pages); the group restarts")
    return sizes


def follow(engine: Any, tp: TensorParallel) -> None:
    """A follower's loop: receive rank 0's commands and carry them out on this rank's
    model and KV pool, until :data:`OP_STOP`.

    Raises:
        RuntimeError: from ``torch.distributed`` when rank 0 is gone (the collective
            fails); the follower then exits.
    """
    header = torch.empty(_HEADER, dtype=torch.int64, device=tp.device)
    _sync_graphs(engine, tp)
    while True:
        dist.broadcast(header, 0)
        values = header.tolist()  # one read back of the header, not one per field
        op = values[0]
        if op == OP_STOP:
            return
        if op == OP_FORWARD:
            t, b, p, n_logits = values[1:5]
            payload = torch.empty(3 * t + b * p + 2 * b + n_logits, dtype=torch.int64, device=tp.device)
            dist.broadcast(payload, 0)
            with torch.inference_mode():
                engine.model(_unpack(header, payload, engine.device), engine.attn)
        elif op == OP_REPLAY:
            with torch.inference_mode():
                engine.runner.graphs.replay_shared(values[1], values[2])
        elif op == OP_COPY_PAGES:
            n = values[1]
            payload = torch.empty(2 * n, dtype=torch.int64, device=tp.device)
            dist.broadcast(payload, 0)
            moves = payload.tolist()
            engine.pool.copy_pages(moves[:n], moves[n:])
        elif op == OP_RESIZE:
            engine.runner.pool_will_move()
            try:
                engine.pool.resize(values[6])
            finally:
                _agree_on_pool(engine, tp)
        else:
            raise RuntimeError(f"unknown command {op} from rank 0")
