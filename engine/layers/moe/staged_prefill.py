"""A long prefill chunk of a host layer with its missing experts staged on the device.

A layer whose routed experts live in pinned host memory reads each missing expert over
the bus inside the fused kernel (:mod:`engine.layers.moe.bus_reads`): the decode GEMV
once per routed pair, the prefill GEMM once per block of ``BLOCK_M`` (64) sorted rows.
A chunk of thousands of tokens routes a hundred rows or more to most experts, so the
GEMM reads each of them over the bus two times or more (a Qwen3-30B-A3B-shape file's
2,048-token chunk: about 2.5 times its 16 GB of host experts, at the 26-38 GB/s a kernel
reads the bus), where the copy engines move the same expert once at the link's rate
(about 46 GB/s on an H100 host, measured by the cost model's copies).

So a chunk of at least :data:`STAGED_ROWS_PER_EXPERT` routed rows an expert on average
takes this way: the routed ids are read back once, the layer's cached experts run from
their slots in one call of the fused kernel (every other expert skipped:
:data:`~kernels.moe.quant_reference.SKIP_SLOT`), and the missing ones pass through a
transient stage of ``2 x`` :data:`STAGE_EXPERTS` slots (fewer for a layer of fewer than
twice that many experts) in waves, the halves alternating:
a wave's copies run on a side stream while the other half computes, each wave one call
of the fused kernel over its slots, the rest skipped. The calls' sums are added in
float32. The stage is allocated per chunk and freed after it (so the plan's measured
prefill peak holds it), and the layer's cache is not touched: its slots keep the
hottest experts for decode.

On the CPU device the same waves run in order (no stream), so the arithmetic is checked
without a GPU.
"""

from __future__ import annotations

import torch

from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.expert_stacks import BlockStack
from kernels.moe.quant_reference import SKIP_SLOT

# Average routed rows an expert at which a chunk is staged: half the prefill GEMM's
# block of 64 rows, where the bus reads begin to repeat (a Qwen3-30B-A3B shape, 128
# experts of top 8: chunks of 512 tokens and more).
STAGED_ROWS_PER_EXPERT = 32
# Experts a wave copies in: the stage holds two waves (a Qwen3-30B-A3B-shape expert is
# 3 MiB of blocks, so 48 MiB).
STAGE_EXPERTS = 8


def takes_staging(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a chunk of ``tokens`` tokens, each routed to ``top_k`` of ``num_experts``
    experts, is staged (module docstring) rather than read over the bus."""
    return tokens * top_k >= STAGED_ROWS_PER_EXPERT * num_experts


class StagedPrefill:
    """The staged way of one host layer (module docstring).

    Args:
        host: the layer's host tier (blocks; pinned on CUDA).
        device: where the chunk computes.
    """

    def __init__(self, host: BlockStack, device: torch.device) -> None:
        self.host, self.device = host, torch.device(device)
        self._stream: torch.cuda.Stream | None = None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, cache: BlockStack,
                slot_of: dict[int, int], counters: ExpertCounters) -> torch.Tensor:
        """The layer's routed experts over ``x``: ``[T, H]`` in ``x``'s dtype.

        Args:
            x: ``[T, H]`` on the device.
            topk_weights, topk_ids: ``[T, K]``, the router's.
            cache: the layer's cache slots; ``slot_of`` which expert each holds.
            counters: the layer's; a cached expert the chunk routes to counts a hit, a
                missing one a miss, a copy and a streamed expert.
        """
        routed = torch.unique(topk_ids).tolist()  # the chunk's one read-back
        cached = [e for e in routed if e in slot_of]
        missing = [e for e in routed if e not in slot_of]
        counters.hits += len(cached)
        counters.misses += len(missing)
        counters.copies += len(missing)
        counters.streamed += len(missing)
        # The stage's size does not depend on the routing, so the plan's profile step
        # (whatever its dummy tokens route to, as long as one is missing: at start the
        # cache is empty) measures the memory a real chunk takes.
        half = min(STAGE_EXPERTS, max(self.host.num_experts // 2, 1))
        waves = [missing[i:i + half] for i in range(0, len(missing), half)]
        # Every call's expert -> slot table, made on the host and sent in one copy (here,
        # where the read-back has already waited for the stream), so that no wave waits
        # for the host: row 0 the cached experts' slots, row 1 + i wave i's stage slots.
        luts = torch.full((1 + len(waves), self.host.num_experts), SKIP_SLOT, dtype=torch.int64)
        for e in cached:
            luts[0, e] = slot_of[e]
        for i, wave in enumerate(waves):
            luts[1 + i, wave] = torch.arange(len(wave)) + (i % 2) * half
        luts = luts.to(x.device)
        stage = self.host.empty(2 * half, x.device) if waves else None
        if x.is_cuda and stage is not None:
            self._stream = self._stream or torch.cuda.Stream(x.device)
            main, side = torch.cuda.current_stream(x.device), self._stream
            for t in stage.tensors:
                # Freed to the allocator only once the side stream's copies into it are
                # done too (also when a wave's call raises).
                t.record_stream(side)
            # Free before any wave: the first copies run beside the cached experts' call.
            freed = [main.record_event(), main.record_event()]
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if cached:
            total += self._run(x, topk_weights, topk_ids, cache, luts[0])
        for i, wave in enumerate(waves):
            base = (i % 2) * half
            if x.is_cuda:
                with torch.cuda.stream(side):
                    side.wait_event(freed[i % 2])  # the wave before in this half has computed
                    for j, e in enumerate(wave):
                        stage.copy_in(base + j, self.host, e, non_blocking=True)
                    main.wait_event(side.record_event())
            else:
                for j, e in enumerate(wave):
                    stage.copy_in(base + j, self.host, e)
            total += self._run(x, topk_weights, topk_ids, stage, luts[1 + i])
            if x.is_cuda:
                freed[i % 2] = main.record_event()
        return total.to(x.dtype)

    def _run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, slots: BlockStack,
             lut: torch.Tensor) -> torch.Tensor:
        """The fused kernel over the experts ``lut`` (int64 ``[E]`` on the device) gives a
        slot of ``slots``, every other expert skipped: ``[T, H]`` float32."""
        return self.host.moe(x, topk_weights, topk_ids, cache=slots, slot_of=lut).float()
