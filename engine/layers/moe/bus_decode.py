"""The bus-read steps of :class:`~engine.layers.moe.expert_cache.OffloadedExperts`, as a
part of that class (:class:`BusDecode`): which steps read over the bus, the step itself
(the fused kernel over the host tier and the cache, :mod:`engine.layers.moe.bus_reads`;
with the CPU's share on, beside the C job, :mod:`engine.layers.moe.share_step`; a long
prefill chunk's missing experts staged on the device instead,
:mod:`engine.layers.moe.staged_prefill`), the CPU's
share of the uncached experts (:mod:`engine.layers.moe.cpu_share`), and the routing
counts folded into the heat and the counters. The hot-set refresh between steps stays
with the class (``after_forward``).

The attributes it reads are :class:`~engine.layers.moe.expert_cache.OffloadedExperts`'
(``host``, ``cache``, ``slot_of``, ``heat``, ``counters``, ``device``, ``live_rows``,
``cpu_kernels``, ``share_rates``, ``on_cpu``, ``top_k``, ``layer_index``, ``_bus``, ``_share``,
``_staged``).
"""

from __future__ import annotations

import logging

import torch

from engine.layers.moe.bus_reads import BUS_COUNTED_TOKENS, HEAT_DECAY, BusReads
from engine.layers.moe.cpu_share import refit_cpu_rate, split_share
from engine.layers.moe.expert_stacks import BlockStack
from engine.layers.moe.share_step import ShareStep
from engine.layers.moe.staged_prefill import StagedPrefill, takes_staging
from kernels.switches import current

log = logging.getLogger("headroom.engine")


class BusDecode:
    """The bus-read part of an offloaded layer (module docstring)."""

    @property
    def decodes_over_bus(self) -> bool:
        """Its CUDA steps read over the bus (blocks, ``expert_bus_reads`` on): a step
        then issues no host sync, and a decode step can be captured in a CUDA graph."""
        return self.device.type == "cuda" and isinstance(self.host, BlockStack) and current().expert_bus_reads

    def _reads_over_bus(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.shape[0] > 0 and self.decodes_over_bus

    def _forward_bus(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The fused GEMV over the host tier and the cache at once
        (:mod:`~engine.layers.moe.bus_reads`): device work only, the bookkeeping in
        :meth:`after_forward`."""
        bus = self._bus = self._bus or BusReads(self.num_experts, self.device)
        decode = x.shape[0] <= BUS_COUNTED_TOKENS
        self.top_k = self.top_k or topk_ids.shape[1]
        if bus.stale:  # never inside a capture: after_forward and resize leave it synced
            bus.sync_lut(self.slot_of, self._split())
        if decode:  # decode steps make the heat; a prefill would swamp it
            bus.count(topk_ids, self.live_rows)
        elif (current().expert_staged_prefill and takes_staging(x.shape[0], topk_ids.shape[1], self.num_experts)
              and not (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            # Eager steps only (it reads the routed ids back): a captured decode graph of
            # many rows (a model of few experts: 8 of top 2 from 128 rows) reads over the bus.
            staged = self._staged = self._staged or StagedPrefill(self.host, self.device)
            return staged.forward(x, topk_weights, topk_ids, self.cache, self.slot_of, self.counters)
        if decode and self.shares_cpu:
            share = self._share = self._share or ShareStep(self.host, self.cpu_kernels, self.device)
            return share.forward(x, topk_weights, topk_ids, bus.share_lut, self.live_rows, lambda: self.host.moe(
                x, topk_weights, topk_ids, cache=self.cache, slot_of=bus.share_lut))
        return self.host.moe(x, topk_weights, topk_ids, cache=self.cache, slot_of=bus.lut)

    @property
    def shares_cpu(self) -> bool:
        """Its bus-read decode steps run a share of the uncached experts on the CPU
        (``expert_cpu_share`` auto, rates measured, the C kernels, an expert uncached)."""
        return (self.share_rates is not None and self.cpu_kernels is not None and self.num_slots < self.num_experts
                and current().expert_cpu_share == "auto")

    def _split(self) -> tuple[int, ...]:
        """The CPU's share now (:func:`~engine.layers.moe.cpu_share.split_share` by the
        heat and the cached set; none before the first decode step), kept in ``on_cpu``."""
        if not (self.shares_cpu and self.top_k is not None):
            self.on_cpu = ()
            return ()
        split = split_share(self.heat, self.slot_of, self.top_k, self.share_rates)
        if not self.on_cpu:  # the first split, or again after none
            log.info("expert CPU share, layer %s: %d of %d uncached experts on the CPU (a step's expected "
                     "%.0f us on the CPU, %.0f us over the bus)", self.layer_index, len(split.cpu),
                     self.num_experts - len(self.slot_of), split.cpu_s * 1e6, split.bus_s * 1e6)
        self.on_cpu = split.cpu
        return self.on_cpu

    def share_job_totals(self) -> tuple[int, float, int]:
        """The CPU share's C job so far, every run together: ``(runs, seconds inside
        them, pairs run)`` (:meth:`kernels.cpu.moe_job.MoeCpuJob.totals`; zeros before the
        first shared step). Read between steps; take differences."""
        if self._share is None or self._share.job is None:
            return 0, 0.0, 0
        return self._share.job.totals()

    def _refit_share(self) -> None:
        """Refit the CPU's rate to what the job took inside the decode steps since the
        last refresh (:func:`~engine.layers.moe.cpu_share.refit_cpu_rate`); the log says
        when it moved by a quarter or more."""
        window = self._share.take_totals()
        rates = refit_cpu_rate(self.share_rates, window)
        if rates is self.share_rates:
            return
        old = self.share_rates
        if (abs(rates.cpu_s - old.cpu_s) >= 0.25 * old.cpu_s
                or abs(rates.job_fixed_s - old.job_fixed_s) >= 0.25 * max(old.job_fixed_s, 1e-6)):
            log.info("expert CPU share, layer %s: inside the decode steps the job ran %d pairs in %d runs "
                     "(%.1f ms); its rates go from %.1f us a run + %.1f us an expert to %.1f + %.1f",
                     self.layer_index, window.pairs, window.runs, window.seconds * 1e3, old.job_fixed_s * 1e6,
                     old.cpu_s * 1e6, rates.job_fixed_s * 1e6, rates.cpu_s * 1e6)
        self.share_rates = rates

    def count_bus_reads(self) -> None:
        """Bring the counters and the heat up to date with the bus-read steps since the
        last refresh (one read-back; nothing when there were none): for stats readers."""
        if self._bus is not None and self._bus.steps:
            self._fold_counts(self._bus)

    def _fold_counts(self, bus: BusReads) -> None:
        """The routing counts since the last fold into the heat, and into the hits and
        bus reads they were."""
        counts, steps = bus.take_counts()
        hit = float(counts[list(self.slot_of)].sum()) if self.slot_of else 0.0
        on_cpu = int(round(float(counts[list(self.on_cpu)].sum())))
        missed = int(round(float(counts.sum()) - hit))
        self.counters.hits += int(round(hit))
        self.counters.misses += missed
        self.counters.cpu_runs += on_cpu
        self.counters.bus_reads += missed - on_cpu
        decay = HEAT_DECAY ** steps
        self.heat = self.heat * decay + (1 - decay) * counts / max(steps, 1)
