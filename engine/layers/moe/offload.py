"""Putting a model's routed experts behind expert caches: :func:`offload_experts` moves
chosen layers' experts to the host tier (:class:`~engine.layers.moe.expert_cache.OffloadedExperts`),
:func:`resize_cache` spreads a slot budget over them (the live replan's handle), and
the step's hooks around a forward (:func:`before_forward`, :func:`after_forward`) keep
their bookkeeping outside it, so that a decode step over them can be captured in a CUDA
graph (:func:`can_capture_decode`)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.layers.moe.bus_reads import LiveRows
from engine.layers.moe.cpu_runs import block_kernels_for
from engine.layers.moe.cpu_share import ShareRates
from engine.layers.moe.expert_cache import OffloadedExperts
from engine.layers.moe.expert_costs import CostModel, measure_stack_costs
from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.expert_stacks import BlockStack, stack_of
from engine.layers.moe.share_step import measure_share_rates
from kernels.switches import current

log = logging.getLogger("headroom.engine")


def offload_experts(model: nn.Module, layers: tuple[int, ...], slots_per_layer: int,
                    costs: CostModel | None = None, device: torch.device | None = None,
                    cpu_kernels: bool = True,
                    like: OffloadedExperts | None = None) -> tuple[list[OffloadedExperts], ExpertCounters]:
    """Move the routed experts of decoder ``layers`` of ``model`` (a
    :class:`engine.models.decoder.CausalLM`) to the host tier, each with a cache of
    ``slots_per_layer`` slots on ``device`` (None: where the experts are now); ``costs``
    None measures them on the first such layer. Dense experts stay dense, a GGUF's
    experts in blocks stay in blocks (:func:`engine.layers.moe.expert_stacks.stack_of`),
    their CPU runs by the C kernels where ``cpu_kernels`` and they build
    (:func:`~engine.layers.moe.cpu_runs.block_kernels_for`; the cost model then times
    those). With the ``expert_cpu_share`` switch on and those kernels, the rates the
    CPU's share splits by are measured on the first such layer
    (:func:`~engine.layers.moe.share_step.measure_share_rates`) and logged. A
    model read into host memory and then moved to the device keeps the stores' tensors
    where they are (plain attributes). ``like``, a store of layers offloaded before,
    makes these layers share its counters, cost model, live rows and share rates (more
    layers of one model moved off the device: a step marks one live-row count for all).

    Returns:
        (the offloaded layers' stores, their shared counters).

    Raises:
        ValueError: a layer in ``layers`` is not a mixture-of-experts layer, or its
            experts are already offloaded.
    """
    counters = ExpertCounters() if like is None else like.counters
    stores = []
    live_rows = None if like is None else like.live_rows
    rates: ShareRates | None = None if like is None else like.share_rates
    costs = costs if like is None else like.costs
    for i in layers:
        mlp = model.model.layers[i].mlp
        if not hasattr(mlp, "experts"):
            raise ValueError(f"layer {i} has no routed experts to offload")
        experts = stack_of(mlp.experts)
        dev = experts.device if device is None else torch.device(device)
        lib = block_kernels_for(experts) if cpu_kernels else None
        if costs is None:
            costs = measure_stack_costs(experts, dev, cpu_kernels=lib)
        slots = min(slots_per_layer, experts.num_experts)
        live_rows = live_rows or LiveRows(dev)
        mlp.experts = OffloadedExperts(experts, dev, slots, counters, costs, lib, live_rows)
        mlp.experts.layer_index = i
        host = mlp.experts.host  # pinned on CUDA: the share's rates are timed on it
        if rates is None and lib is not None and isinstance(host, BlockStack) and \
                current().expert_cpu_share == "auto":
            rates = measure_share_rates(host, dev, lib, costs)
            log.info("expert CPU share: rates a routed expert of bus %.1f us, CPU %.1f us (+ %.1f us a step); "
                     "an even routing's 8 missing experts %.0f us over the bus, %.0f us shared", rates.bus_s * 1e6,
                     rates.cpu_s * 1e6, rates.cpu_fixed_s * 1e6, 8 * rates.bus_s * 1e6, rates.balanced_s(8) * 1e6)
        mlp.experts.share_rates = rates
        del experts
        stores.append(mlp.experts)
    if stores and stores[0].device.type == "cuda":
        torch.cuda.empty_cache()
    return stores, counters


def resize_cache(stores: list[OffloadedExperts], total_slots: int) -> None:
    """Spread ``total_slots`` over ``stores`` evenly (the first layers get the
    remainder) and resize each: the live replan's handle on the expert cache."""
    if not stores:
        return
    each, extra = divmod(total_slots, len(stores))
    for i, s in enumerate(stores):
        s.resize(min(each + (i < extra), s.num_experts))


def stores_in(model: nn.Module) -> list[OffloadedExperts]:
    """The offloaded layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, OffloadedExperts)]


def can_capture_decode(stores: list[OffloadedExperts]) -> bool:
    """Whether a decode step over ``stores`` issues no host sync (every layer reads its
    missing experts over the bus): it can then be captured in a CUDA graph."""
    return all(s.decodes_over_bus for s in stores)


def before_forward(stores: list[OffloadedExperts], live: int) -> None:
    """Before a forward: its first ``live`` rows are requests, the others a CUDA graph's
    padding (:class:`~engine.layers.moe.bus_reads.LiveRows`); ``live`` 0 while a graph is
    captured."""
    if stores:
        stores[0].live_rows.mark(live)


def after_forward(stores: list[OffloadedExperts], tokens: int) -> None:
    """After a forward of ``tokens`` rows (a replayed graph's padded size), between
    steps: each layer's bus-read bookkeeping
    (:meth:`~engine.layers.moe.expert_cache.OffloadedExperts.after_forward`)."""
    for s in stores:
        s.after_forward(tokens)
