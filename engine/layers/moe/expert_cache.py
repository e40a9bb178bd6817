"""Routed experts kept in host memory, with a device expert cache in front of them.

A layer whose routed experts live on the host (pinned when the device is CUDA) swaps
its experts module for an :class:`OffloadedExperts`: the full stack of ``E`` experts
stays in the **host tier**, and a **cache tier** of ``S`` slots (a stack of ``S`` on the
device) holds the experts recently used. Both tiers hold the experts in the form the
layer had (:mod:`engine.layers.moe.expert_stacks`): dense ``[E, 2I, H]`` / ``[E, H, I]``
stacks of :class:`engine.layers.moe.sparse_moe.Experts`, or a GGUF's blocks of
:class:`engine.layers.moe.quant_experts.QuantExperts`, so a copy moves blocks (a quarter to
a third of the dense bytes) and a cached expert runs through the quantized kernels.
Each step, for every expert the router picked:

- in the cache: a hit; it runs on the device from its slot;
- missing: :class:`~engine.layers.moe.expert_costs.CostModel` decides, for the number of tokens routed to it, whether
  copying it in (host -> device, ``non_blocking`` from pinned memory) or running it on
  the CPU (the activations copied over and back) is cheaper; a copy is credited with
  the later steps it is expected to serve from the cache (the expert's recent share of
  steps, a decayed average, times the cache's slots: about how many steps a slot stays
  before LRU evicts it). A copy evicts the least recently used slot that this step does
  not need.
- missing with every slot holding an expert of this step (a prefill chunk routes to
  most experts): it is **streamed** when a copy still beats the CPU run. Once the
  cached experts have run, the rest pass through the same slots in waves, the slots
  split in two halves that alternate: on CUDA the copies go on a side stream, so a
  half fills while the other half computes (events order them), and the last waves
  stay in the cache. A prefill of thousands of tokens would otherwise run most of a
  layer's experts on the CPU, at tens of milliseconds each, where a copy takes a
  fraction of one.

Nothing here assumes CUDA: with the device being the CPU, the host tier is one CPU
tensor and the cache tier another, and the same choices, copies and evictions happen,
so the logic is checked without a GPU.

Steps on CUDA of a host tier of GGUF blocks take another way, with no host round trip
(:mod:`engine.layers.moe.bus_reads`, the ``expert_bus_reads`` switch): the fused kernels
read the missing experts from the pinned host tier over the bus and the cached ones
from their slots, and the cache holds the hottest experts by measured routing.

A host tier of GGUF blocks runs its CPU experts by the C kernels where they build
(:mod:`engine.layers.moe.cpu_runs`: all of a step's CPU experts in one call over the
cores, in their blocks); otherwise, and for dense stacks, one expert at a time through
torch (blocks dequantized on each run). On CPU, without the C kernels, the experts run one by one in expert
order, exactly as the references of :func:`kernels.moe.reference.fused_moe` and
:func:`kernels.moe.quant_reference.fused_moe_quant` do, so outputs are equal to the
all-resident model's; on CUDA the cached experts run through the fused kernel (dense or
over blocks) over slot indices.

:meth:`OffloadedExperts.resize` grows or shrinks the cache between steps (a live
replan), evicting least recently used slots; the host tier always has every expert,
so no request can fail for it. With ``expert_cpu_share`` on, a bus-read decode step
runs part of the missing experts on the CPU beside the kernel
(:mod:`engine.layers.moe.cpu_share`).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import torch
from torch import nn

from engine.layers.moe.bus_decode import BusDecode
from engine.layers.moe.bus_reads import (
    BUS_COUNTED_TOKENS,
    HEAT_DECAY,
    REFRESH_STEPS,
    BusReads,
    LiveRows,
    hot_swaps,
)
from engine.layers.moe.cpu_runs import CpuRun, compute_cpu_run, gather_cpu_run
from engine.layers.moe.cpu_share import ShareRates
from engine.layers.moe.expert_costs import CostModel, expert_mlp
from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.expert_stacks import ExpertStack
from engine.layers.moe.share_step import ShareStep
from engine.layers.moe.staged_prefill import StagedPrefill


class OffloadedExperts(BusDecode, nn.Module):
    """One layer's routed experts in the host tier, ``num_slots`` of them cached on
    ``device``.

    Args:
        experts: the layer's experts, any device, in the form the tiers keep
            (:class:`~engine.layers.moe.expert_stacks.DenseStack` or
            :class:`~engine.layers.moe.expert_stacks.BlockStack`); copied to host memory,
            pinned when ``device`` is CUDA.
        num_slots: cache slots, ``0 <= num_slots <= E``.
        counters: shared totals (one object for all layers).
        costs: the copy-or-CPU rule.
        cpu_kernels: the C kernels that run missing experts in their blocks
            (:func:`~engine.layers.moe.cpu_runs.block_kernels_for`), or None: torch.
        live_rows: which rows of a step count towards the heat, shared by the model's
            offloaded layers (None: a fresh one, every row).
        share_rates: the rates the CPU's share splits by (None: no share).

    Attributes:
        host: the host tier, every expert. cache: the cache tier, ``num_slots`` on
        ``device``. slot_of: expert -> slot, least recently used first.

    Raises:
        ValueError: ``num_slots`` outside ``0..E``.
    """

    def __init__(self, experts: ExpertStack, device: torch.device, num_slots: int,
                 counters: ExpertCounters, costs: CostModel, cpu_kernels: ctypes.CDLL | None = None,
                 live_rows: LiveRows | None = None, share_rates: ShareRates | None = None) -> None:
        super().__init__()
        self.share_rates = share_rates
        self.on_cpu: tuple[int, ...] = ()  # the CPU's share of the uncached experts
        self.top_k: int | None = None  # known from the first bus-read decode step
        self.layer_index: int | None = None  # the decoder layer's, for the log
        self._share: ShareStep | None = None
        self._staged: StagedPrefill | None = None  # made at the first staged chunk
        self.live_rows = live_rows or LiveRows(torch.device(device))
        self.cpu_kernels = cpu_kernels
        self.device = torch.device(device)
        self.host = experts.on_host(pin=self.device.type == "cuda")
        self.num_experts = self.host.num_experts
        self.counters = counters
        self.costs = costs
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        # Each expert's share of recent steps that routed to it (decayed average).
        self.heat = torch.zeros(self.num_experts, dtype=torch.float64)
        self.cache = self.host.empty(0, self.device)
        self._copy_stream: torch.cuda.Stream | None = None  # created on the first streamed step
        self._bus: BusReads | None = None  # created on the first bus-read decode step
        self.resize(num_slots)

    @property
    def num_slots(self) -> int:
        return self.cache.num_experts

    @property
    def slot_bytes(self) -> int:
        """One slot's device bytes (one expert as the tiers hold it)."""
        return self.host.expert_bytes

    def resize(self, num_slots: int) -> None:
        """Hold ``num_slots`` slots (``0..E``): shrinking evicts the least recently used
        experts and compacts the rest into the low slots; growing keeps every cached
        expert. Between steps only."""
        if not 0 <= num_slots <= self.num_experts:
            raise ValueError(f"num_slots {num_slots} is not in 0..{self.num_experts}")
        while len(self.slot_of) > num_slots:
            self.slot_of.popitem(last=False)
            self.counters.evictions += 1
        keep = list(self.slot_of.items())
        cache = self.host.empty(num_slots, self.device)
        for new, (expert, old) in enumerate(keep):
            cache.copy_in(new, self.cache, old)
            self.slot_of[expert] = new
        # Free the old cache before the caller plans with the new size.
        self.cache = cache
        if self._bus is not None:
            self._bus.sync_lut(self.slot_of, self._split())

    def _free_slot(self, pinned: set[int]) -> int | None:
        """A slot to fill: an empty one, else the least recently used expert's that
        this step does not need (evicted); None when every slot is needed."""
        used = set(self.slot_of.values())
        for s in range(self.num_slots):
            if s not in used:
                return s
        for expert, slot in self.slot_of.items():
            if expert not in pinned:
                del self.slot_of[expert]
                self.counters.evictions += 1
                return slot
        return None

    def _place(self, tokens_per_expert: dict[int, int]) -> tuple[set[int], list[int]]:
        """Bring in what the cost model says to copy; count hits and misses. Returns
        the experts to run on the CPU this step and those to stream through the slots
        after the cached ones have run (in expert order)."""
        on_cpu: set[int] = set()
        streamed: list[int] = []
        active = set(tokens_per_expert)
        self.heat *= HEAT_DECAY
        self.heat[list(active)] += 1 - HEAT_DECAY
        # The busiest experts first: when the cache cannot take every expert of a
        # prefill chunk, those with the most tokens get the slots.
        for expert, n in sorted(tokens_per_expert.items(), key=lambda kv: -kv[1]):
            if expert in self.slot_of:
                self.counters.hits += 1
                self.slot_of.move_to_end(expert)
                continue
            self.counters.misses += 1
            reuse = float(self.heat[expert]) * self.num_slots
            slot = self._free_slot(active) if self.costs.prefers_copy(n, reuse) else None
            if slot is not None:
                self._fill([(expert, slot)])
                self.slot_of[expert] = slot
                self.counters.copies += 1
            elif self.num_slots and self.costs.prefers_copy(n):
                streamed.append(expert)
                self.counters.copies += 1
                self.counters.streamed += 1
            else:
                on_cpu.add(expert)
                self.counters.cpu_runs += 1
        return on_cpu, sorted(streamed)

    def _waves(self, streamed: list[int]) -> list[list[tuple[int, int]]]:
        """``(expert, slot)`` waves for ``streamed``: the slots split in two halves
        used in turn, so one half can fill while the other computes (one half with a
        single slot). The cache keeps the experts the last waves leave in it, most
        recent last."""
        half = (self.num_slots + 1) // 2
        halves = [list(range(half)), list(range(half, self.num_slots))] if self.num_slots > 1 else [[0]]
        waves: list[list[tuple[int, int]]] = []
        rest = list(streamed)
        while rest:
            slots = halves[len(waves) % len(halves)]
            waves.append(list(zip(rest[:len(slots)], slots, strict=False)))
            rest = rest[len(slots):]
        holder = {slot: expert for expert, slot in self.slot_of.items()}
        for wave in waves:
            for expert, slot in wave:
                old = holder.pop(slot, None)
                if old is not None:
                    del self.slot_of[old]
                    self.counters.evictions += 1
                holder[slot] = expert
                self.slot_of[expert] = slot
        return waves

    def _fill(self, wave: list[tuple[int, int]]) -> None:
        for expert, slot in wave:
            self.cache.copy_in(slot, self.host, expert, non_blocking=True)

    def _run_cpu(self, x: torch.Tensor, tokens: torch.Tensor, expert: int) -> torch.Tensor:
        xh = x[tokens].to("cpu", self.host.cpu_dtype)
        y = expert_mlp(xh, *self.host.weights_of(expert, xh.dtype))
        return y.to(x.device, x.dtype, non_blocking=True)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """As :func:`kernels.moe.reference.fused_moe` with this layer's experts: ``x`` ``[T, H]``,
        ``topk_weights``/``topk_ids`` ``[T, K]`` -> ``[T, H]`` in ``x``'s dtype."""
        if self._reads_over_bus(x):
            return self._forward_bus(x, topk_weights, topk_ids)
        if self._bus is not None:
            self._bus.stale = True  # this step may change what the slots hold
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        experts, counts = torch.unique(topk_ids, return_counts=True)
        on_cpu, streamed = self._place(dict(zip(experts.tolist(), counts.tolist(), strict=True)))
        if x.is_cuda:
            if streamed:
                return self._forward_streamed(x, topk_weights, topk_ids, experts.tolist(), counts.tolist(),
                                              on_cpu, streamed)
            return self._forward_fused(x, topk_weights, topk_ids, on_cpu, len(experts))
        # Every expert's output first, then added in expert order with the reference's
        # ops: equal to the all-resident model whatever ran where (the C kernels' CPU
        # runs apart: one sum of theirs, within float32 rounding of it).
        ys: dict[int, torch.Tensor] = {}
        by_kernels = on_cpu if self.cpu_kernels is not None else set()
        if by_kernels:
            self._add_cpu_runs(out, x, topk_weights, topk_ids, by_kernels)

        def run(e: int, slot: int | None) -> None:
            tokens, ks = torch.where(topk_ids == e)
            if slot is None:
                y = self._run_cpu(x, tokens, e)
            else:
                y = expert_mlp(x[tokens], *self.cache.weights_of(slot, x.dtype))
            ys[e] = (y * topk_weights[tokens, ks, None]).to(x.dtype)

        for e in experts.tolist():
            if e not in streamed and e not in by_kernels:
                run(e, None if e in on_cpu else self.slot_of[e])
        for wave in self._waves(streamed):
            self._fill(wave)
            for e, slot in wave:
                run(e, slot)
        for e in experts.tolist():
            if e in ys:
                    out.index_add_(0, torch.where(topk_ids == e)[0], ys[e])
        return out

    def after_forward(self, tokens: int) -> None:
        """Between steps, after a forward of ``tokens`` rows (a replayed graph's padded
        size): count a bus-read step, refresh the hot set every :data:`REFRESH_STEPS`,
        and leave the device lut saying what ``slot_of`` says."""
        bus = self._bus
        if bus is None:
            return
        if tokens <= BUS_COUNTED_TOKENS:
            bus.steps += 1
        if bus.steps >= REFRESH_STEPS:
            self._refresh_hot(bus)
            bus.stale = bus.stale or self.shares_cpu  # the heat moved: split again
            if self._share is not None:
                self._share.check()
                self._refit_share()
        if bus.stale:
            bus.sync_lut(self.slot_of, self._split())

    def _refresh_hot(self, bus: BusReads) -> None:
        """Fold the routing counts in, then copy in the experts that became hotter than
        cached ones."""
        self._fold_counts(bus)
        for expert, old in hot_swaps(self.heat, self.slot_of, self.num_slots):
            if old is None:
                slot = self._free_slot(set())
            else:
                slot = self.slot_of.pop(old)
                self.counters.evictions += 1
            self._fill([(expert, slot)])
            self.slot_of[expert] = slot
            self.counters.swaps += 1
            bus.stale = True

    def _forward_fused(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       on_cpu: set[int], num_active: int) -> torch.Tensor:
        """The cached experts through the fused kernel over slot ids (a CPU-run
        expert's rows get weight 0 and any valid slot), plus the CPU-run experts."""
        lut = torch.zeros(self.num_experts, dtype=torch.int64)
        for e, s in self.slot_of.items():
            lut[e] = s
        slot_ids = lut.to(x.device, non_blocking=True)[topk_ids]
        weights = topk_weights
        if on_cpu:
            cpu_mask = torch.zeros(self.num_experts, dtype=torch.bool)
            cpu_mask[list(on_cpu)] = True
            weights = topk_weights.masked_fill(cpu_mask.to(x.device)[topk_ids], 0)
        # The CPU's pairs read back first (the GPU is idle: nothing waits), so that the
        # C kernels run while the GPU computes the cached experts.
        begun = self._begin_cpu_runs(x, topk_weights, topk_ids, on_cpu)
        if self.num_slots > 0 and len(on_cpu) < num_active:
            out = self.cache.moe(x, weights, slot_ids)
        else:
            out = torch.zeros_like(x)
        self._add_cpu_runs(out, x, topk_weights, topk_ids, on_cpu, begun)
        return out

    def _begin_cpu_runs(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        on_cpu: set[int]) -> CpuRun | None:
        """The CPU-run pairs read back for the C kernels, or None (none, or no kernels)."""
        if self.cpu_kernels is None or not on_cpu:
            return None
        return gather_cpu_run(self.num_experts, x, topk_weights, topk_ids, on_cpu)

    def _add_cpu_runs(self, out: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, on_cpu: set[int], begun: CpuRun | None = None) -> None:
        """Add the CPU-run experts' sums into ``out``: by the C kernels (from ``begun``'s
        pairs when :meth:`_begin_cpu_runs` read them back already), else one expert at a
        time through torch."""
        if self.cpu_kernels is not None and on_cpu:
            run = begun or gather_cpu_run(self.num_experts, x, topk_weights, topk_ids, on_cpu)
            sums = compute_cpu_run(self.host, self.cpu_kernels, run)
            out.index_add_(0, run.rows, sums.to(x.device, x.dtype, non_blocking=True))
            return
        for e in sorted(on_cpu):
            tokens, ks = torch.where(topk_ids == e)
            y = self._run_cpu(x, tokens, e)
            out.index_add_(0, tokens, (y * topk_weights[tokens, ks, None]).to(x.dtype))

    def _forward_streamed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          experts: list[int], counts: list[int], on_cpu: set[int],
                          streamed: list[int]) -> torch.Tensor:
        """A step routing to more experts than the slots hold, on CUDA: the cached
        experts' rows through the fused kernel, then each wave's rows once its copy
        (on the side stream) is done; a half's next copy waits for the compute that
        read it. Rows are gathered per group from one sort of the routed pairs, with
        offsets known on the host, so nothing waits for the device."""
        k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        start = dict(zip(experts, torch.tensor([0, *counts[:-1]]).cumsum(0).tolist(), strict=True))
        size = dict(zip(experts, counts, strict=True))
        cached = [(e, self.slot_of[e]) for e in experts if e in self.slot_of]
        groups = [cached, *self._waves(streamed)]
        # Each group's expert -> slot table, sent in one copy.
        table = torch.zeros(len(groups), self.num_experts, dtype=torch.int64, pin_memory=True)
        for g, group in enumerate(groups):
            for e, slot in group:
                table[g, e] = slot
        table = table.to(x.device, non_blocking=True)
        out = torch.zeros_like(x)
        begun = self._begin_cpu_runs(x, topk_weights, topk_ids, on_cpu)  # before any GPU work: see _forward_fused

        def compute(g: int) -> None:
            rows = torch.cat([order[start[e]:start[e] + size[e]] for e, _ in groups[g]])
            tokens = rows // k
            y = self.cache.moe(x[tokens], topk_weights.flatten()[rows, None], table[g][flat_ids[rows]][:, None])
            out.index_add_(0, tokens, y)

        if cached:
            compute(0)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(x.device)
        main = torch.cuda.current_stream(x.device)
        # One event per half (as _waves splits the slots): a half's next fill waits for
        # the last compute that read it; with one slot, every wave waits for the last.
        halves = 2 if self.num_slots > 1 else 1
        freed = [main.record_event()] * halves
        for g in range(1, len(groups)):
            half = (g - 1) % halves
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(freed[half])
                self._fill(groups[g])
                filled = self._copy_stream.record_event()
            main.wait_event(filled)
            compute(g)
            freed[half] = main.record_event()
        self._add_cpu_runs(out, x, topk_weights, topk_ids, on_cpu, begun)
        return out
