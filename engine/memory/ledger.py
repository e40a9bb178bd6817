"""The memory plan's arithmetic: the ledger from the device's memory, the knobs and the
model's footprint (:func:`make_plan`; the lines are drawn in :mod:`engine.memory.plan`'s
docstring), the routed experts placed in host memory where ``--cpu-experts`` asks or
the plan needs it, the settings that would make a plan that does not fit fit (each
priced by planning again), and :func:`fit_plan`, which lowers the prefill chunk before
it gives up. Torch-free."""

from __future__ import annotations

import math
from dataclasses import replace

import msgspec

from engine.common.config import EngineConfig
from engine.common.options import option_named
from engine.common.units import count_of, fmt_bytes
from engine.memory.kv_fit import RING_FLOOR_REQUESTS, kv_pages, ring_pool_cap
from engine.memory.kv_fit import ring_line as ring_words
from engine.memory.plan import (
    MIN_PREFILL_TOKENS,
    DeviceMemory,
    Footprint,
    LedgerEntry,
    MemoryPlan,
    PlanKnobs,
    Suggestion,
    reserve_for,
    safety_margin_for,
)
from engine.memory.plan_fit import most_requests_that_fit


def make_plan(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint) -> MemoryPlan:
    """Compute the ledger for ``device`` with ``knobs`` and the model's ``fp``.

    Never raises for a plan that does not fit: ``fits`` is False, ``shortfall_bytes`` and
    ``suggestions`` say what to change (each priced by planning again with that knob
    moved). Raises ValueError only for nonsensical inputs (negative sizes).
    """
    plan = _ledger(device, knobs, fp)
    if plan.fits:
        return plan
    return msgspec.structs.replace(plan, suggestions=_suggest(device, knobs, fp, plan))


def _weight_lines(fp: Footprint, host_layers: int, cpu_layers: int = 0) -> list[LedgerEntry]:
    """``weights``, and for a mixture of experts the routed experts apart from the rest
    (attention, router, shared experts, embeddings); the routed experts of
    ``host_layers`` layers, and the last ``cpu_layers`` decoder layers, live in host
    memory, not here."""
    if cpu_layers:
        moved, host = fp.moved_bytes(cpu_layers)
        return [LedgerEntry("weights", fp.weight_bytes - moved, "-",
                            f"{fp.weight_source}; the last {cpu_layers} of {len(fp.layer_bytes)} decoder layers "
                            f"({fmt_bytes(moved)}) in host memory as {fmt_bytes(host)}")]
    if fp.expert_weight_bytes <= 0:
        return [LedgerEntry("weights", fp.weight_bytes, "-", fp.weight_source)]
    host_bytes = fp.host_expert_bytes(host_layers)
    on_device = fp.expert_weight_bytes - host_bytes
    where = "all on the device" if host_layers == 0 else (
        f"{fp.expert_layers - host_layers} of {fp.expert_layers} layers on the device, "
        f"{host_layers} ({fmt_bytes(host_bytes)}) in pinned host memory")
    source = f"exact, {fp.expert_form} as stored" if fp.expert_form else "exact, from tensor shapes"
    return [
        LedgerEntry("weights", fp.weight_bytes - fp.expert_weight_bytes, "-",
                    fp.weight_source + "; all but the routed experts"),
        LedgerEntry("routed expert weights", on_device, "-", f"{source}; {where}"),
    ]


def host_expert_layers(knobs: PlanKnobs, fp: Footprint) -> int | None:
    """The layers ``--cpu-experts`` puts in host memory: a number (capped by the
    model's mixture-of-experts layers), 0 for none, None for auto (the plan decides)."""
    if fp.expert_layers == 0 or knobs.cpu_experts == "none":
        return 0
    if knobs.cpu_experts == "auto":
        return None
    return min(int(knobs.cpu_experts), fp.expert_layers)


# Before a profile, an auto placement (a mixture's experts, a dense model's split) keeps this
# much beyond one --min-context request (expert cache and KV pages past it, which a measured
# plan can give back): what estimates placed stays. The CUDA context measured 794 MiB against
# the 512 MiB estimate on an H200 as a 6 GiB card (30B-A3B, 113 MiB short), 1,167 on an H100 as 8 GiB (8B split).
PLACEMENT_MARGIN_BYTES = 512 << 20


def cpu_decoder_layers(knobs: PlanKnobs, fp: Footprint) -> int | None:
    """The last decoder layers ``--cpu-layers`` runs on the CPU: a number (capped by the
    model's layers; 0 for a model that cannot split), None for auto (the plan decides)."""
    if not fp.layer_bytes:
        return 0
    if knobs.cpu_layers == "auto":
        return None
    return min(int(knobs.cpu_layers), len(fp.layer_bytes) - 1)  # one layer stays on the device


def _ledger(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint) -> MemoryPlan:
    cpu = cpu_decoder_layers(knobs, fp)
    if cpu is not None:
        return _placed(device, knobs, fp, cpu)
    # auto: none when the model fits; else the fewest layers on the CPU that fit within the
    # host's available memory (with the placement margin to spare if any count leaves it);
    # none (the refusal) when no split does.
    whole = _placed(device, knobs, fp, 0)
    if whole.fits:
        return whole
    margin = PLACEMENT_MARGIN_BYTES if fp.activation_source == "estimated" else 0
    fitting = None
    for layers in range(1, len(fp.layer_bytes)):  # one layer stays on the device
        plan = _placed(device, knobs, fp, layers)
        if plan.fits and _host_need(plan, fp) <= (device.host_available_bytes or _UNKNOWN):
            if _spare(plan) >= margin:
                return plan
            fitting = fitting or plan
    return fitting or whole


_UNKNOWN = 1 << 62  # the host's available memory where the OS does not say


def _host_need(plan: MemoryPlan, fp: Footprint) -> int:
    """Host bytes a plan's split takes: its layers' weights and their KV pool (as many
    pages as the device's)."""
    pages = plan.num_pages + 1  # and the null page
    return fp.moved_bytes(plan.cpu_layers)[1] + pages * plan.page_size * plan.cpu_layers * fp.host_kv_bytes_per_token_layer


def _host_page_cap(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint, cpu_layers: int) -> int | None:
    """The most KV pages whose host pool (the split's layers' keys and values, the null
    page included) takes at most half of the host's available memory left beside those
    layers' weights (the desktop's other programs keep the rest); None where the OS does
    not say. The device pool holds the same page count, so a device with room to spare
    would otherwise size a host pool the host cannot hold."""
    available = device.host_available_bytes
    per_page = knobs.page_size * cpu_layers * fp.host_kv_bytes_per_token_layer
    if available is None or per_page <= 0:
        return None
    return max((available - fp.moved_bytes(cpu_layers)[1]) // 2 // per_page - 1, 0)


def _placed(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint, cpu_layers: int) -> MemoryPlan:
    """The plan with the last ``cpu_layers`` decoder layers on the CPU and the routed
    experts placed as ``--cpu-experts`` says (auto: the fewest layers that fit). A split's
    pool is capped at what the host holds (:func:`_host_page_cap`), never below one
    request of the minimum context (the note then says the host would swap)."""
    plan = _placed_experts(device, knobs, fp, cpu_layers)
    if not cpu_layers:
        return plan
    cap = _host_page_cap(device, knobs, fp, cpu_layers)
    if cap is not None and plan.num_pages > cap:
        need_pages = math.ceil(plan.min_context_tokens / knobs.page_size)
        plan = _ledger_at(device, knobs, fp, 0, cpu_layers, max_pages=max(cap, need_pages))
    plan = msgspec.structs.replace(plan, cpu_layers=cpu_layers)
    layers = len(fp.layer_bytes)
    moved, host = fp.moved_bytes(cpu_layers)
    need = _host_need(plan, fp)
    available = device.host_available_bytes
    note = (f"decoder layers {layers - cpu_layers}-{layers - 1} ({cpu_layers} of {layers}) run on the CPU "
            f"(--cpu-layers {cpu_layers}): {fmt_bytes(moved)} of weights moved off the device ({fmt_bytes(host)} in "
            f"host memory) and their KV in a host pool ({fmt_bytes(need - host)}); each step runs them on the CPU, "
            f"so decode is slower and runs without CUDA graphs; {fmt_bytes(need)} of host memory"
            + (f" of {fmt_bytes(available)} available" if available is not None else ""))
    if available is not None and need > available:
        note += " (more than is available: the host would swap)"
    return msgspec.structs.replace(plan, split_note=note)


def _placed_experts(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint, cpu_layers: int) -> MemoryPlan:
    host = host_expert_layers(knobs, fp)
    if host is not None:
        return _ledger_at(device, knobs, fp, host, cpu_layers)
    # auto: none when everything fits; else the fewest offloaded layers that fit (from
    # estimates: with the margin to spare, else without); all of them when none does.
    whole = _ledger_at(device, knobs, fp, 0, cpu_layers)
    if whole.fits:
        return whole  # the common case: one plan, not one per layer count
    plans = [_ledger_at(device, knobs, fp, layers, cpu_layers) for layers in range(1, fp.expert_layers + 1)]
    margin = PLACEMENT_MARGIN_BYTES if fp.activation_source == "estimated" else 0
    for wanted in (margin, 0):
        for plan in plans:
            if plan.fits and _spare(plan) >= wanted:
                return plan
    return plans[-1] if plans else whole


def _spare(plan: MemoryPlan) -> int:
    """What a plan holds beyond one request of its minimum context: the expert cache and
    the KV pages past those that request needs, in bytes."""
    page = plan.kv_bytes_per_token * plan.page_size
    need = math.ceil(plan.min_context_tokens / plan.page_size) * page
    return plan.kv_pool_bytes + plan.expert_cache_slots * plan.expert_slot_bytes - need


def _ledger_at(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint, host_layers: int,
               cpu_layers: int = 0, max_pages: int | None = None) -> MemoryPlan:
    if min(device.total_bytes, device.free_bytes, device.others_bytes, fp.weight_bytes) < 0:
        raise ValueError("memory sizes must be >= 0")
    total = device.total_bytes
    if knobs.device_limit is not None:
        total = min(total, knobs.device_limit)
    reserve = knobs.reserve if knobs.reserve is not None else reserve_for(total, device.display_attached)
    margin = knobs.safety_margin_bytes if knobs.safety_margin_bytes is not None else safety_margin_for(total)
    src = "simulated" if device.simulated else "NVML"
    # A simulated card's display is its own (--device-display), not this machine's.
    attached = "auto: the simulated card drives a display" if device.simulated else "auto: display attached"
    reserve_src = _flag("reserve") if knobs.reserve is not None else (
        attached if device.display_attached else "auto: no display"
    )
    budget = total - device.others_bytes - reserve - margin
    sampler = fp.sampler_bytes_per_request * knobs.max_running_requests
    activation = fp.activation_at(knobs) if fp.activation_at is not None else fp.activation_peak_bytes
    ledger = [
        LedgerEntry("device total", total, "+", src + (" (a card of --device-limit)" if total < device.total_bytes else
                                                       f" (--device-limit {fmt_bytes(knobs.device_limit)} is larger: "
                                                       "the card's size applies)"
                                                       if knobs.device_limit is not None and knobs.device_limit > total
                                                       else "")),
        LedgerEntry("used by other processes", device.others_bytes, "-", src + ", now"),
        LedgerEntry("desktop reserve", reserve, "-", reserve_src),
        LedgerEntry("safety margin", margin, "-", "auto" if knobs.safety_margin_bytes is None else "flag"),
        # Never a negative line: what the reserves take beyond the device is said in words.
        LedgerEntry("budget", max(budget, 0), "=", f"does not fit: {fmt_bytes(-budget)} short" if budget < 0 else ""),
        *_weight_lines(fp, host_layers, cpu_layers),
        LedgerEntry("CUDA context and runtime", fp.runtime_bytes, "-", fp.runtime_source if fp.runtime_bytes else "none"),
    ]
    ledger += [LedgerEntry(f"workspace: {name}", b, "-", "declared") for name, b in fp.workspace_bytes]
    ledger += [
        LedgerEntry("sampler and logits", sampler, "-", f"{fp.sampler_source}, {count_of(knobs.max_running_requests, 'request')} x vocab {fp.vocab_size}"),
        LedgerEntry("prefill activation peak", activation, "-", f"{fp.activation_source} at {knobs.max_prefill_tokens} tokens"
                    + (", linear-attention layers included" if fp.state_bytes_per_request else "")),
        LedgerEntry("CUDA graph pool", fp.cuda_graph_bytes, "-", "measured at capture" if fp.cuda_graph_bytes else "none captured"),
        LedgerEntry("model scratch", fp.scratch_bytes, "-", "measured" if fp.scratch_bytes else "none"),
    ]
    # One slot per running request, the null slot, and the prefix cache's checkpoints
    # (engine.kvcache.state_pool).
    slots = knobs.max_running_requests + 1 + knobs.state_checkpoints
    states = fp.state_bytes_per_request * slots
    if fp.state_bytes_per_request:
        ledger.append(LedgerEntry("linear-attention state pool", states, "-",
                                  f"exact, {knobs.max_running_requests} requests + 1 null slot + "
                                  f"{knobs.state_checkpoints} prefix-cache checkpoints x "
                                  f"{fmt_bytes(fp.state_bytes_per_request)}"))
    # Sliding-window layers that keep only their window (engine.kvcache.ring): the ring
    # pool follows the KV pool's pages P, min(the running requests' rings + checkpoints'
    # pages, P) and its null page, priced below once P is known.
    ring_page = fp.kv_ring_page_bytes if fp.kv_ring_pages is not None else 0
    ring_pages, checkpoint_pages, decode_pages = fp.kv_ring_pages(knobs) if ring_page else (0, 0, 0)
    ring_cap = full_cap = ring_pages + checkpoint_pages
    floor_requests = min(knobs.max_running_requests, RING_FLOOR_REQUESTS)
    floor_pages = fp.kv_ring_pages(replace(knobs, max_running_requests=floor_requests))[0] if ring_page else 0
    ring_extra = 1 if ring_page else 0
    ring_line = len(ledger)
    moved, _ = fp.moved_bytes(cpu_layers)
    fixed = (fp.weight_bytes - moved + fp.runtime_bytes + sum(b for _, b in fp.workspace_bytes) + sampler + activation
             + fp.cuda_graph_bytes + fp.scratch_bytes + states + ring_extra * ring_page)
    # The layers on the CPU keep their KV in the host pool: a device page holds the rest.
    kv_per_token = fp.kv_bytes_per_token * (len(fp.layer_bytes) - cpu_layers) // len(fp.layer_bytes) \
        if cpu_layers else fp.kv_bytes_per_token
    page_bytes = kv_per_token * knobs.page_size

    def kv_cost(p: int) -> int:
        """Device bytes of a KV pool of ``p`` pages: each page over the global layers,
        and ``min(the rings' bound + checkpoints' pages, p)`` ring pages over the sliding
        ones (their null page is in ``fixed``)."""
        return p * page_bytes + min(p, ring_cap) * ring_page

    model_ctx = fp.model_context_tokens if knobs.max_model_len is None else min(fp.model_context_tokens, knobs.max_model_len)
    min_ctx = min(knobs.min_context or model_ctx, model_ctx)
    need_pages = math.ceil(min_ctx / knobs.page_size)
    slots = 0
    slot = fp.host_slot_bytes(host_layers)
    if host_layers > 0:
        fixed -= fp.host_expert_bytes(host_layers)
        spare = budget - fixed - kv_cost(need_pages)
        slots = int(min(max(spare // 2, 0) // slot, host_layers * fp.num_experts)) if slot > 0 else 0
        fixed += slots * slot
        form = f" ({fp.expert_form})" if fp.expert_form else ""
        ledger.append(LedgerEntry("expert cache", slots * slot, "-",
                                  f"{slots} slots of {fmt_bytes(slot)}{form} for {host_layers} layers x "
                                  f"{fp.num_experts} experts in host memory"))
    kv_room = budget - fixed
    # The ring pool below its bound where that lets the KV pool hold the wanted context
    # (engine.memory.kv_fit); kv_cost follows.
    ring_cap = ring_pool_cap(kv_room, page_bytes, ring_page, full_cap, floor_pages,
                             math.ceil(model_ctx / knobs.page_size))
    pages = kv_pages(kv_room, page_bytes, ring_page, ring_cap)
    host_capped = max_pages is not None and pages > max_pages
    if host_capped:
        pages = max_pages  # the host pool of a split follows the device's page count
    kv_bytes = pages * page_bytes
    rings = min(pages, ring_cap)
    if ring_page:
        fixed += rings * ring_page
        ledger.insert(ring_line, LedgerEntry("sliding-window KV rings", (rings + 1) * ring_page, "-", ring_words(
            rings, fmt_bytes(ring_page), cap=ring_cap, kv_pages=pages, full_cap=full_cap, ring_pages=ring_pages,
            checkpoint_pages=checkpoint_pages, requests=knobs.max_running_requests,
            checkpoints=knobs.state_checkpoints, decode_pages=decode_pages, floor_requests=floor_requests)))
    ledger.append(LedgerEntry("KV cache pool", kv_bytes, "=", f"{pages} pages of {fmt_bytes(page_bytes)}"
                                                     + (", capped by the host pool of the CPU layers' KV (half the host's available memory)"
                                                        if host_capped else "")
                                                     + (f", {fp.kv_cache_dtype}" if fp.kv_cache_dtype else "")
                                                     + (f"; {fp.kv_window_note}" if fp.kv_window_note else "")))
    fits = pages >= need_pages
    max_ctx = int(min(model_ctx, pages * knobs.page_size))
    note = ""
    if fits and max_ctx < model_ctx:
        note = f"context {model_ctx:,} -> {max_ctx:,} tokens: " + (
            f"{fmt_bytes(device.others_bytes)} held by other processes"
            if device.others_bytes > 0
            else f"the budget of {fmt_bytes(budget)} leaves {fmt_bytes(kv_bytes)} for the KV cache"
        )
    return MemoryPlan(
        # Under --device-limit the plan is for the smaller card: name that one.
        device=device.name if total == device.total_bytes else f"{device.name} as a {fmt_bytes(total)} card (--device-limit)",
        simulated=device.simulated,
        ledger=ledger,
        budget_bytes=budget,
        fixed_bytes=fixed,
        kv_pool_bytes=kv_bytes,
        kv_cache_dtype=fp.kv_cache_dtype,
        kv_bytes_per_token=kv_per_token,
        num_pages=int(pages),
        kv_ring_pages=int(rings),
        page_size=knobs.page_size,
        max_context_tokens=max_ctx,
        min_context_tokens=min_ctx,
        fits=fits,
        shortfall_bytes=0 if fits else int(kv_cost(need_pages) - kv_room),
        suggestions=[],
        max_prefill_tokens=knobs.max_prefill_tokens,
        max_running_requests=knobs.max_running_requests,
        state_bytes_per_request=fp.state_bytes_per_request,
        wanted_context_tokens=model_ctx,
        context_note=note,
        cpu_expert_layers=host_layers,
        expert_cache_slots=slots,
        expert_slot_bytes=slot if host_layers else 0,
        tensor_parallel_size=knobs.tensor_parallel_size,
        kv_heads=fp.kv_heads,
    )


def _flag(name: str) -> str:
    """The command-line flag of the engine option ``name`` (a suggestion names it)."""
    return option_named(EngineConfig, name).flag


def _kv_room(plan: MemoryPlan) -> int:
    return plan.budget_bytes - plan.fixed_bytes


def _suggest(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint, plan: MemoryPlan) -> list[Suggestion]:
    """Price each knob moved in the direction that frees memory; keep those that free
    something, the ones that make the plan fit first, largest saving first."""
    base = _kv_room(plan)
    candidates: list[tuple[str, str, str, PlanKnobs]] = []
    chunk = knobs.max_prefill_tokens
    if chunk > MIN_PREFILL_TOKENS:
        for smaller in (max(chunk // 4, MIN_PREFILL_TOKENS), max(chunk // 2, MIN_PREFILL_TOKENS)):
            candidates.append((_flag("max_prefill_tokens"), str(chunk), str(smaller), replace(knobs, max_prefill_tokens=smaller)))
    running = knobs.max_running_requests
    if running > 1:  # a quarter, and the most that fit unsplit
        unsplit = "0" if knobs.cpu_layers == "auto" else knobs.cpu_layers
        most = most_requests_that_fit(lambda k: _ledger(device, replace(k, cpu_layers=unsplit), fp), knobs)
        for fewer in {max(running // 4, 1)} | ({most[1].max_running_requests} if most else set()):
            candidates.append((_flag("max_running_requests"), str(running), str(fewer), replace(knobs, max_running_requests=fewer)))
    ctx = plan.min_context_tokens
    if ctx > 512:
        shorter = max(ctx // 4, 512)
        candidates.append((_flag("min_context"), str(ctx), str(shorter), replace(knobs, min_context=shorter)))
    reserve = next(e.bytes for e in plan.ledger if e.name == "desktop reserve")
    if reserve > 0:  # halved; one past twice the card's automatic (display) reserve, down to that
        auto = reserve_for(next(e.bytes for e in plan.ledger if e.name == "device total"), True)
        lower = auto if reserve > 2 * auto else reserve // 2
        candidates.append((_flag("reserve"), fmt_bytes(reserve), fmt_bytes(lower), replace(knobs, reserve=lower)))
    host = host_expert_layers(knobs, fp)
    if host is not None and host < fp.expert_layers:
        for more in sorted({min(max(host * 2, 1), fp.expert_layers), fp.expert_layers}):
            candidates.append((_flag("cpu_experts"), knobs.cpu_experts, str(more), replace(knobs, cpu_experts=str(more))))
    cpu = cpu_decoder_layers(knobs, fp)
    layers = len(fp.layer_bytes)
    if layers > 1 and (cpu or 0) < layers - 1:
        for more in sorted({max(layers // 4, 1), max(layers // 2, 1), layers - 1} - set(range((cpu or 0) + 1))):
            candidates.append((_flag("cpu_layers"), knobs.cpu_layers, str(more), replace(knobs, cpu_layers=str(more))))
    # Per flag: the gentlest move that makes the plan fit, else the one that frees most.
    best: dict[str, tuple[bool, Suggestion]] = {}
    for flag, cur, new, k in candidates:
        other = _ledger(device, k, fp)
        # A shorter context lowers the KV need, not fixed memory: price it by the shortfall.
        if flag == _flag("min_context"):
            saved = plan.shortfall_bytes - other.shortfall_bytes
        else:
            saved = _kv_room(other) - base
        if saved <= 0:
            continue  # never suggest a direction that does not help
        price = ""
        if flag == _flag("cpu_experts"):
            price = f"decode slows: an expert missing from the GPU cache is copied over PCIe or run on the CPU; needs {fmt_bytes(fp.host_expert_bytes(int(new)))} of host memory"
        if flag == _flag("cpu_layers"):
            price = (f"the last {new} of {layers} decoder layers run on the CPU each step, decode slows; needs "
                     f"{fmt_bytes(_host_need(other, fp))} of host memory")
        s = Suggestion(flag, cur, new, int(saved), price)
        held = best.get(flag)
        if held is None or _better((other.fits, s), held):
            best[flag] = (other.fits, s)
    # A split that does not fit alone costs speed on every step: named after the others.
    split = best.pop(_flag("cpu_layers"), None)
    if split is not None and split[0]:
        best[_flag("cpu_layers")], split = split, None
    ranked = sorted(best.values(), key=lambda fs: (not fs[0], -fs[1].saves_bytes))
    suggestions = [s for _, s in ranked][:3] + ([split[1]] if split is not None else [])
    if device.others_bytes > 0:
        suggestions.append(Suggestion("close other GPU applications", fmt_bytes(device.others_bytes), "0", device.others_bytes))
    return suggestions


def _better(a: tuple[bool, Suggestion], b: tuple[bool, Suggestion]) -> bool:
    if a[0] != b[0]:
        return a[0]
    # Both fit: the smaller change; neither fits: the larger saving.
    return a[1].saves_bytes < b[1].saves_bytes if a[0] else a[1].saves_bytes > b[1].saves_bytes
