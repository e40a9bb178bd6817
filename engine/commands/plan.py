"""``headroom plan``: print the memory ledger for a model and a device, without serving.

Reads the model's config only (no weights); plans the dtype and device ``headroom
serve`` would (:func:`planned_setup`); the activation peak is the estimate the
engine starts from (a served GPU engine replaces it with its profile run's measurement).
"""

from __future__ import annotations

import dataclasses

import msgspec
import torch

from engine.commands.plan_fixed_pool import FixedPool, fixed_setting, with_fixed_pool
from engine.common.config import EngineConfig
from engine.common.gpu_settings import gpu_only_settings
from engine.core.settings_fit import check_for_model
from engine.core.startup import (
    device_memory,
    estimated_planner,
    quantized_gguf,
    resolve_device,
    resolve_dtype,
    use_kernel_switches,
    weight_format,
)
from engine.loader.gguf_quant import gguf_weight_size
from engine.loader.hf_config import load_model_config
from engine.loader.resolve import resolve_model
from engine.memory.kv_fit import usable_pages
from engine.memory.plan import MemoryPlan, PlanKnobs
from engine.memory.plan_fit import fit_model_plan
from engine.parallel.split import rank_model_config


class NoDevice(Exception):
    """No GPU to plan for and no simulated device given."""


class CpuWithoutPlan(NoDevice):
    """A CPU run without a simulated device: the engine fits no plan there
    (:func:`cpu_holdings` says what it holds instead)."""


def planned_setup(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype ``headroom serve`` would plan with ``config``: ``--device``
    as the engine resolves it (``cuda`` with ``--device-total`` is taken as named, so a
    CUDA card can be priced on a machine without one), and dtype ``auto`` for that device (float32 on a CPU,
    even when a simulated card stands in for the GPU's memory).

    Raises:
        NoDevice: neither a CUDA device nor a simulated one; the message names the flags.
        ValueError: an unknown dtype.
    """
    if config.device_total is not None and config.device.startswith("cuda"):
        # A simulated card stands in for the GPU: pricing it needs no CUDA here.
        device = torch.device(config.device)
    else:
        device = resolve_device(config.device)
    if config.device_total is None and device.type == "cpu":
        raise CpuWithoutPlan("on the CPU the engine fits no memory plan; --device-total SIZE plans for a budget")
    if config.device_total is None and device.type != "cuda":
        raise NoDevice(
            "no CUDA device here: plan for a simulated card with --device-total SIZE "
            "(and --device-free SIZE), e.g. --device-total 6GiB --device-free 5.5GiB"
        )
    return device, resolve_dtype(config.dtype, device)


def build_plan(config: EngineConfig) -> MemoryPlan:
    """The plan the engine would start from for ``config``, with the same decisions: the
    prefill chunk lowered, then the context lowered down to ``--min-context``
    (:func:`engine.memory.plan_fit.fit_model_plan`); a plan that does not fit even so is returned
    with ``fits`` False. A KV pool fixed by ``--num-pages`` or ``--kv-cache`` is priced
    as the engine runs it (:func:`plan_with_pool`).

    With ``--tensor-parallel-size N`` it is one rank's plan: the weights split N ways,
    the KV heads divided by N (``plan.tensor_parallel_size`` says N).

    Raises:
        as :func:`plan_with_pool`.
    """
    return plan_with_pool(config)[0]


def plan_with_pool(config: EngineConfig) -> tuple[MemoryPlan, FixedPool | None]:
    """:func:`build_plan`'s plan, and for a KV pool fixed by ``--num-pages`` or
    ``--kv-cache`` (the engine then fits no plan) the ledger of that pool instead, with
    the :class:`~engine.commands.plan_fixed_pool.FixedPool` that says what it replaced
    (None when the plan sizes the pool).

    Raises:
        NoDevice: see :func:`planned_setup`.
        engine.common.load_errors.ModelLoadError: the model is missing or its config broken.
        engine.common.errors.SettingRefused: a setting the model cannot honour
            (:func:`engine.core.settings_fit.check_for_model`), a ``--kv-cache`` below
            one ``--min-context``.
    """
    use_kernel_switches(config)
    device, dtype = planned_setup(config)
    whole = load_model_config(resolve_model(config.model))
    check_for_model(config, whole)
    # With tensor parallel, rank 0's plan (each rank's alike): its heads, KV heads, MLP
    # width and vocabulary slice, as the engine builds it (engine.parallel.split).
    mc = rank_model_config(whole, config.tensor_parallel_size)
    # Priced as the engine will load it: dense (dequantized) unless --gguf-quantized
    # keeps a GGUF's blocks on a CUDA device.
    weights = weight_format(config, device, dtype, mc, resolve_model(config.model)).size
    memory = device_memory(config, device)
    assert memory is not None
    planner = estimated_planner(config, mc, device, dtype, memory, weights=weights)
    plan, _ = fit_model_plan(planner, PlanKnobs.of(config, device.type), config, mc)
    if fixed_setting(config) is None:
        return plan, None
    return with_fixed_pool(planner, config, mc, dtype, plan)


def render(plan: MemoryPlan, as_json: bool, setup: str = "", fixed: FixedPool | None = None) -> str:
    """The plan as a ledger table (with the fix when it does not fit), or as JSON;
    ``setup`` (e.g. "float32 on cpu") follows the device in the table's head; ``fixed``:
    the KV pool a setting fixed (its fixes, when it does not fit)."""
    if as_json:
        return msgspec.json.encode(plan).decode()
    head = f"memory plan for {plan.device}" + (f", {setup}" if setup else "") + "\n"
    body = plan.table()
    if plan.tensor_parallel_size > 1:
        n = plan.tensor_parallel_size
        head += (f"tensor parallel: the plan of one rank of {n}; weights split {n} ways"
                 + (f", {plan.kv_heads} KV heads per rank" if plan.kv_heads else "")
                 + f"; each of the {n} GPUs needs this budget\n")
    if plan.kv_bytes_per_token:
        per = " per rank" if plan.tensor_parallel_size > 1 else ""
        body += f"\nKV cache: {plan.kv_bytes_per_token:,} bytes per token{per} ({plan.kv_cache_dtype})"
    if plan.fits:  # where --max-running-requests is unset, what the card holds (engine.memory.plan_fit)
        body += f"\nrunning requests: {plan.max_running_requests} at most" + (
            f" ({plan.requests_note})" if plan.requests_note else "")
    if fixed is not None:
        body += f"\nwarning: {fixed.warning}" if fixed.warning else ""
        return f"{head}{body}\nfits: yes" if plan.fits else f"{head}{body}\nfits: no\n\n{fixed.message(plan)}"
    if plan.context_lowered:
        return f"{head}{body}\nfits: yes, with a lowered context (--min-context {plan.min_context_tokens})"
    if plan.fits:
        return f"{head}{body}\nfits: yes"
    return f"{head}{body}\nfits: no\n\n{plan.message()}"


class CpuHoldings(msgspec.Struct, frozen=True):
    """What a CPU engine without a plan holds in host memory (bytes): its weights as
    loaded, and its KV pool, sized as :func:`engine.memory.fixed_pool.unplanned_pool`
    sizes it (an anonymous map: resident only where written). ``host_*``: the machine's
    memory, ``host_available_bytes`` None where the OS does not say.

    ``num_pages`` and ``fits`` are named and counted as a plan's
    (:class:`engine.memory.plan.MemoryPlan`), so ``plan --json`` carries them on every
    device: ``num_pages`` the KV pool's usable pages (the null page apart), ``fits``
    whether the weights and the pools, counted whole, fit the host memory available now
    (its total where the OS does not say), as serve counts a grow."""

    model: str
    dtype: str
    weight_bytes: int
    weight_source: str
    kv_pool_bytes: int
    num_pages: int
    fits: bool
    page_size: int
    kv_bytes_per_token: int
    kv_cache_dtype: str
    max_context_tokens: int
    host_total_bytes: int
    host_available_bytes: int | None
    # Settings given that only shape a GPU's plan, in words (empty when none was).
    gpu_only: tuple[str, ...] = ()
    # Sliding-window layers that keep only their window (--sliding-kv-ring): the ring
    # pool's bytes (a ring per running request, checkpoints and the null page), its
    # pages (the null page apart, as num_pages), and one ring's pages between steps.
    kv_ring_bytes: int = 0
    kv_ring_pages: int = 0
    kv_ring_window_pages: int = 0
    # --num-pages holding less than one --min-context, in words (else None).
    pool_warning: str | None = None


def cpu_holdings(config: EngineConfig) -> CpuHoldings:
    """:class:`CpuHoldings` of ``config`` on the CPU, from the model's config and (for a
    GGUF) its tensor table, without loading the weights.

    Raises:
        engine.common.load_errors.ModelLoadError: the model is missing or its config broken.
        ValueError: an unknown dtype or KV cache dtype.
        engine.common.errors.SettingRefused: a setting the model cannot honour
            (:func:`engine.core.settings_fit.check_for_model`).
    """
    from engine.core.footprint import kv_bytes_per_token, kv_ring, kv_ring_page_bytes
    from engine.kvcache.pool import kv_storage_dtype
    from engine.loader.default_model import model_display_name
    from engine.loader.weight_size import weight_bytes
    from engine.memory.plan import PlanKnobs
    from kernels.attention.kv_store import kv_dtype_name

    use_kernel_switches(config)
    from engine.memory.fixed_pool import short_pool_warning, unplanned_pool
    from engine.memory.host import host_memory

    device = torch.device("cpu")
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model(config.model)
    mc = load_model_config(model_dir)
    # What serve refuses before it loads, as build_plan does; on the CPU the pool is in host memory.
    check_for_model(dataclasses.replace(config, device="cpu"), mc)
    gguf = quantized_gguf(config, device, mc)
    if gguf is not None:
        size = gguf_weight_size(gguf, mc, dtype, device.type)
        weights, source = size.bytes, f"exact, {size.source}: {size.mix}"
    else:
        weights, source = weight_bytes(mc, dtype), f"exact, {str(dtype).removeprefix('torch.')} tensors"
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
    knobs = PlanKnobs.of(config, device.type)
    ring = kv_ring(mc, knobs)
    per_token = kv_bytes_per_token(mc, kv_dtype, ring)
    price = ring.price(kv_ring_page_bytes(mc, kv_dtype, ring), knobs.max_running_requests,
                       knobs.state_checkpoints) if ring else None
    size = unplanned_pool(config, mc, per_token * config.page_size, price)
    pages = usable_pages(size.pages)
    ring_bytes = (size.rings + 1) * price.page_bytes if price else 0
    context = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings,
                  pages * config.page_size)
    total, available = host_memory()
    pool_bytes = pages * per_token * config.page_size
    fits = weights + pool_bytes + ring_bytes <= (total if available is None else available)
    return CpuHoldings(
        model=model_display_name(model_dir), dtype=str(dtype).removeprefix("torch."), weight_bytes=weights,
        weight_source=source, kv_pool_bytes=pool_bytes, num_pages=pages, fits=fits,
        page_size=config.page_size, kv_bytes_per_token=per_token, kv_cache_dtype=kv_dtype_name(kv_dtype),
        max_context_tokens=context, host_total_bytes=total, host_available_bytes=available,
        gpu_only=gpu_only_settings(config.cpu_layers, config.device_limit), kv_ring_bytes=ring_bytes, kv_ring_pages=size.rings,
        kv_ring_window_pages=ring.decode_pages if ring else 0, pool_warning=short_pool_warning(config, mc))


def render_cpu(h: CpuHoldings, as_json: bool) -> str:
    """:class:`CpuHoldings` as a table (or JSON)."""
    if as_json:
        return msgspec.json.encode(h).decode()
    from engine.common.units import fmt_bytes

    def row(name: str, n: int, note: str) -> str:
        return f"  {name:<24} {n / 2**20:>10.1f} MiB   {note}"

    available = "" if h.host_available_bytes is None else f", {fmt_bytes(h.host_available_bytes)} available now"
    rows = [
        f"host memory of {h.model} on cpu ({h.dtype}): no plan is fitted on the CPU; the engine holds",
        row("weights", h.weight_bytes, h.weight_source),
        row("KV cache pool", h.kv_pool_bytes, f"{h.num_pages} pages x {h.page_size} tokens, {h.kv_cache_dtype}, "
            f"resident only where written (headroom serve --kv-cache sets its size)"),
        *([row("sliding-window KV rings", h.kv_ring_bytes, f"{h.kv_ring_pages} pages: a ring of up to "
               f"{h.kv_ring_window_pages} pages per running request between steps, a prefill chunk's more in its "
               "step (no more than the KV pool's pages in all), prefix-cache checkpoints and the null page, for the layers "
               "that keep only their window")] if h.kv_ring_bytes else []),
        row("at most", h.weight_bytes + h.kv_pool_bytes + h.kv_ring_bytes, f"of {fmt_bytes(h.host_total_bytes)}{available}"),
        f"KV cache: {h.kv_bytes_per_token:,} bytes per token; max context {h.max_context_tokens:,} tokens",
        "plus a step's activations and the runtime (torch); --device-total SIZE plans the pool for a budget "
        "instead",
    ]
    if h.pool_warning:
        rows.append(f"warning: {h.pool_warning}")
    if not h.fits:
        rows.append("fits: no: the weights and the KV pool, counted whole, exceed the host memory available now; "
                    "a smaller --kv-cache (or a smaller model) fits")
    if h.gpu_only:
        rows.append(f"{' and '.join(h.gpu_only)}: no effect on the CPU (every layer runs there already; they split or "
                    "limit a GPU's plan): plan for a card with --device cuda --device-total SIZE")
    return "\n".join(rows)
