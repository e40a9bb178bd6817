"""Putting a model's routed experts behind expert caches: :func:`offload_experts` moves
chosen layers' experts to the host tier (:class:`~engine.layers.moe.expert_cache.OffloadedExperts`),
:func:`resize_cache` spreads a slot budget over them (the live replan's handle), and
the step's hooks around a forward (:func:`before_forward`, :func:`after_forward`) keep
their bookkeeping outside it, so that a decode step over them can be captured in a CUDA
graph (:func:`can_capture_decode`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe.bus_reads import LiveRows
from engine.layers.moe.cpu_runs import block_kernels_for
from engine.layers.moe.expert_cache import OffloadedExperts
from engine.layers.moe.expert_costs import CostModel, measure_stack_costs
from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.expert_stacks import stack_of


def offload_experts(model: nn.Module, layers: tuple[int, ...], slots_per_layer: int,
                    costs: CostModel | None = None, device: torch.device | None = None,
                    cpu_kernels: bool = True) -> tuple[list[OffloadedExperts], ExpertCounters]:
    """Move the routed experts of decoder ``layers`` of ``model`` (a
    :class:`engine.models.decoder.CausalLM`) to the host tier, each with a cache of
    ``slots_per_layer`` slots on ``device`` (None: where the experts are now); ``costs``
    None measures them on the first such layer. Dense experts stay dense, a GGUF's
    experts in blocks stay in blocks (:func:`engine.layers.moe.expert_stacks.stack_of`),
    their CPU runs by the C kernels where ``cpu_kernels`` and they build
    (:func:`~engine.layers.moe.cpu_runs.block_kernels_for`; the cost model then times
    those). A
    model read into host memory and then moved to the device keeps the stores' tensors
    where they are (plain attributes).

    Returns:
        (the offloaded layers' stores, their shared counters).

    Raises:
        ValueError: a layer in ``layers`` is not a mixture-of-experts layer, or its
            experts are already offloaded.
    """
    counters = ExpertCounters()
    stores = []
    live_rows = None
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
