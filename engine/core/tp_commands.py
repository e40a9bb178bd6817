"""The command broadcast of a tensor-parallel group: what rank 0 sends the followers
before each step, graph replay and KV pool change, as a fixed header of int64 words (an
opcode first) and an optional int64 payload. Rank 0 sends through :func:`send_command`;
the followers' loop (:mod:`engine.core.tp_follow`) and the graphs' replay
(:mod:`engine.core.tp_graphs`) read the opcodes here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.parallel.group import TensorParallel

# Header: [op, num_tokens, batch, max_pages, num_logits, is_decode, num_pages, ring]:
# OP_FORWARD fills words 1-5 and ``ring`` (1: the sliding layers' ring table and slots
# follow the step's inputs, engine.kvcache.ring); OP_COPY_PAGES the moves (word 1) and
# ``ring`` (1: pages of the ring pool); OP_RESIZE and OP_RESIZE_RING ``num_pages`` (the
# KV pool's, the ring pool's); OP_REPLAY words 1-2 (engine.core.tp_graphs).
HEADER_WORDS = 8
OP_FORWARD, OP_COPY_PAGES, OP_RESIZE, OP_STOP, OP_REPLAY, OP_RESIZE_RING = 1, 2, 3, 4, 5, 6
WORD_PAGES, WORD_RING = 6, 7


def send_command(tp: TensorParallel, header: list[int], payload: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast ``header`` (padded with zeros to :data:`HEADER_WORDS` int64
    words), then ``payload`` (int64, any shape) when it is not empty; every other rank
    receives them in the same order."""
    dist.broadcast(torch.tensor(header + [0] * (HEADER_WORDS - len(header)), dtype=torch.int64, device=tp.device), 0)
    if payload is not None and payload.numel():
        dist.broadcast(payload.to(tp.device, torch.int64).contiguous(), 0)
