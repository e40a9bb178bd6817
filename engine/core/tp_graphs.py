"""The decode step's CUDA graphs on every rank of a tensor-parallel group.

Each rank captures the same batch sizes, in the same order, with the model's
all-reduces and the vocabulary all-gather inside the graph: ``torch.distributed`` with
NCCL records a collective into a capture instead of running it (NCCL 2.9.6 or later;
torch keeps captured collectives away from its watchdog), so a replay on every rank runs
the captured collectives against each other. The communicator exists before the first
capture (the group is formed with ``device_id``, and the profile step and the warm-ups
run the same collectives eagerly first), and each warm-up runs on the capture stream
itself, the stream the capture records on.

A replayed step, in the order every rank runs it:

1. rank 0 sends the step's header (``OP_REPLAY``, the padded batch size, the number of
   input words) over the command broadcast (:mod:`engine.core.tp_commands`);
2. a size not captured yet (the first use after a KV pool resize dropped the graphs) is
   captured on every rank, and the ranks agree it worked (a MIN all-reduce of 0/1): a
   size that failed anywhere runs eagerly on every rank until the next resize, as on
   one GPU;
3. rank 0 writes the inputs into its static buffer (one upload from pinned memory) and
   broadcasts that packed buffer (ids, positions, KV slots, lengths, page table) over
   NCCL, device to device, straight into every follower's static buffer;
4. every rank replays its graph.

The followers do no host work per step beyond reading the header, unless the attention
backend plans on the host (FlashInfer): then a follower reads its received inputs back
for the plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.core.tp_commands import OP_REPLAY, send_command
from engine.parallel.group import TensorParallel


class GraphSync:
    """What :class:`engine.core.cuda_graphs.DecodeGraphs` does with the other ranks: announce
    a replay (rank 0), agree that a capture worked, share the step's inputs (rank 0
    sends, the followers receive into their static buffers)."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def announce(self, padded: int, words: int) -> None:
        """Rank 0: tell the followers a replay of ``padded`` rows reading ``words`` input
        words follows (the followers' loop receives it; a no-op on a follower)."""
        if self.tp.is_leader:
            send_command(self.tp, [OP_REPLAY, padded, words])

    def agree(self, ok: bool) -> bool:
        """True when the capture worked on every rank (a collective every rank runs)."""
        return self.tp.min_int(int(ok)) == 1

    def share(self, inputs: torch.Tensor) -> None:
        """Broadcast ``inputs`` (a view of the static input buffer) from rank 0 into the
        same view on every rank."""
        dist.broadcast(inputs, 0)
