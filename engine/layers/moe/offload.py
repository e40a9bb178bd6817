"""Putting a model's routed experts behind expert caches: :func:`offload_experts` moves
chosen layers' experts to the host tier (:class:`~engine.layers.moe.expert_cache.OffloadedExperts`),
:func:`resize_cache` spreads a slot budget over them (the live replan's handle)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe.cpu_runs import block_kernels_for
from engine.layers.moe.expert_cache import ExpertCounters, OffloadedExperts
from engine.layers.moe.expert_costs import CostModel, measure_stack_costs
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
        mlp.experts = OffloadedExperts(experts, dev, slots, counters, costs, lib)
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
