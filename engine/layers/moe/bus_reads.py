"""Steps of a layer whose routed experts live in host memory, with no host round trip:
the fused kernel reads each routed expert from its device cache slot when it has one,
else straight from the pinned host tier over the bus (PCIe; one address space with the
device), :func:`kernels.moe.quant_triton_kernel.fused_moe_quant` with a ``cache``.

A step then costs what the bus moves (the missing experts' blocks: read once per routed
pair by the decode GEMV, once per block of rows by the prefill GEMM) and a handful of
launches: nothing is copied ahead, nothing read back, and the
layer does not wait for the host to decide. Copying a missing expert in first moves the
same bytes and adds a read-back of the routed ids and a wait per layer; running it on
the CPU reads host memory at the CPU's rate instead (both remain the prefill path of
:class:`~engine.layers.moe.expert_cache.OffloadedExperts`, where an expert serves many
tokens).

The cache holds the **hottest** experts by measured routing frequency: each step adds
its routed ids to a device-side count; every :data:`REFRESH_STEPS` steps the counts are
read back once, folded into the layer's decayed heat, and at most
:data:`SWAPS_PER_REFRESH` experts hotter than a cached one by :data:`SWAP_MARGIN` are
copied in (stream-ordered: kernels already queued still read the slot's old expert).
An even routing, where no expert is hotter than another for long, hardly swaps at all.

The forward's part (the kernel and :meth:`BusReads.count`) is device work only, so the
decode CUDA graphs hold it; the host's part (counting steps, the refresh, the slot
table's upload) runs between steps
(:meth:`~engine.layers.moe.expert_cache.OffloadedExperts.after_forward`), and
:class:`LiveRows` keeps a graph's padding rows out of the counts.
"""

from __future__ import annotations

import torch

from kernels.moe.quant_reference import SKIP_SLOT

# Per-step decay of an expert's heat: an average over about the last 1 / (1 - 0.95) = 20
# steps.
HEAT_DECAY = 0.95
# Counted steps between two read-backs of a layer's routing counts.
REFRESH_STEPS = 16
# Steps of up to this many tokens count towards the heat (decode batches; a prefill
# chunk routes to nearly every expert and says little of what decode will want).
BUS_COUNTED_TOKENS = 16
# Experts copied into a layer's cache at most per refresh (each a few MB over the bus).
SWAPS_PER_REFRESH = 4
# An expert replaces a cached one when its heat is above the cached one's times this.
SWAP_MARGIN = 1.5


class LiveRows:
    """Which rows of a step's forward are requests, shared by a model's offloaded layers:
    ``weights`` (float32 ``[BUS_COUNTED_TOKENS]``), 1.0 for a request's row and 0.0 for a
    CUDA graph's padding row, so that padding (token 0 at position 0, the same experts
    every step) never heats an expert. All rows are live unless :meth:`mark` says less."""

    def __init__(self, device: torch.device) -> None:
        self.weights = torch.ones(BUS_COUNTED_TOKENS, dtype=torch.float32, device=device)
        self.live = BUS_COUNTED_TOKENS

    @torch.inference_mode()
    def mark(self, live: int) -> None:
        """Rows ``[0, live)`` are requests, the rest padding (stream-ordered; nothing
        launched when it did not change)."""
        live = min(max(live, 0), BUS_COUNTED_TOKENS)
        if live != self.live:
            self.weights[:live].fill_(1.0)
            self.weights[live:].fill_(0.0)
            self.live = live


class BusReads:
    """One offloaded layer's decode state on the device: ``lut`` (int64 ``[E]``, the slot
    of each cached expert, -1 for the others), ``share_lut`` (the same with
    :data:`~kernels.moe.quant_reference.SKIP_SLOT` for the experts the CPU's share runs,
    :mod:`engine.layers.moe.cpu_share`) and ``routed`` (float32 ``[E]``, routings per
    expert since the last refresh). Its forward part (:meth:`count`) launches only
    device work, so a CUDA graph can hold it; ``steps`` is kept by the caller between
    steps."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.lut = torch.full((num_experts,), -1, dtype=torch.int64, device=device)
        self.share_lut = self.lut.clone()
        self.routed = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.stale = True  # the lut no longer says what slot_of says
        self.steps = 0

    def count(self, topk_ids: torch.Tensor, rows: LiveRows) -> None:
        """Add a step's routed pairs (``[T, K]``, ``T <= BUS_COUNTED_TOKENS``) of its live
        rows to the counts, on the device."""
        t, k = topk_ids.shape
        self.routed.index_add_(0, topk_ids.reshape(-1), rows.weights[:t, None].expand(t, k).reshape(-1))

    # Both run between steps too (stats, a refresh), outside the step's inference mode,
    # on tensors the first step may have made inside it.
    @torch.inference_mode()
    def sync_lut(self, slot_of: dict[int, int], on_cpu: tuple[int, ...] = ()) -> None:
        """Write ``slot_of`` (expert -> slot) into the device luts, and the CPU's share
        ``on_cpu`` into ``share_lut``, in stream order."""
        lut = torch.full(self.lut.shape, -1, dtype=torch.int64)
        for e, s in slot_of.items():
            lut[e] = s
        self.lut.copy_(lut)
        lut[list(on_cpu)] = SKIP_SLOT
        self.share_lut.copy_(lut)
        self.stale = False

    @torch.inference_mode()
    def take_counts(self) -> tuple[torch.Tensor, int]:
        """The routings per expert since the last call (float64 ``[E]``, on the host: one
        read-back) and the steps they span; both reset."""
        counts = self.routed.double().cpu()
        self.routed.zero_()
        steps, self.steps = self.steps, 0
        return counts, steps


def hot_swaps(heat: torch.Tensor, cached: dict[int, int], num_slots: int) -> list[tuple[int, int | None]]:
    """``(expert to bring in, cached expert it replaces or None for a free slot)`` pairs
    by ``heat`` (float64 ``[E]``): the hottest uncached experts first, each against the
    coldest cached one left, while it is hotter by :data:`SWAP_MARGIN`; at most
    :data:`SWAPS_PER_REFRESH`."""
    free = num_slots - len(cached)
    order = torch.argsort(heat, descending=True).tolist()
    candidates = [e for e in order if e not in cached and heat[e] > 0][:SWAPS_PER_REFRESH]
    coldest = sorted(cached, key=lambda e: float(heat[e]))
    swaps: list[tuple[int, int | None]] = []
    for e in candidates:
        if free > 0:
            swaps.append((e, None))
            free -= 1
        elif coldest and heat[e] > SWAP_MARGIN * heat[coldest[0]]:
            swaps.append((e, coldest.pop(0)))
        else:
            break
    return swaps
