"""The memory plan: from the device's free memory to a number of KV pages.

Torch-free arithmetic, so the same code plans a real GPU (numbers from NVML and a
profile run) and a simulated one (numbers from flags or a test), and the service can
show a plan without importing torch.

The ledger, top to bottom::

    device total                 NVML (or --device-total); with --device-limit a card of that size
  - used by other processes      NVML, now (or total - --device-free)
  - desktop reserve              --reserve (auto: see reserve_for)
  - safety margin                fragmentation and allocator rounding
  = budget
  - weights                      exact, from tensor shapes
  - routed expert weights        a mixture of experts' routed experts kept on the device
  - attention workspace          declared by the backend
  - sampler and logits           max running requests x vocab
  - prefill activation peak      measured by a profile run (estimated before it)
  - CUDA graph pool              measured at capture
  - model scratch                measured in the profile run
  - expert cache                 slots for the experts of layers in host memory (--cpu-experts)
  = KV cache pool                whole pages, never negative

Hybrid placement (``--cpu-experts``): the routed experts of some mixture-of-experts
layers live in pinned host memory; the device keeps everything else and an expert
cache of whole slots (one expert's ``[2I, H] + [H, I]``) taking half of what is left
once one request of ``--min-context`` has its KV pages (the KV pool gets the rest),
capped at every offloaded expert. ``auto`` offloads the fewest layers that make the
plan fit (none when it fits whole).

A plan that cannot hold one request of the wanted context (the model's, capped by
``--max-model-len``) but can hold one of ``min_context_tokens`` (``--min-context``)
fits with a lowered context: ``max_context_tokens`` is what the pool holds, and
:attr:`MemoryPlan.context_note` says why ("context 8192 -> 3,456 tokens: 1.1 GiB held
by other processes"). Below that floor it does not fit; its :meth:`MemoryPlan.message`
says by how much and which settings fix it; :func:`fit_plan` lowers the prefill
chunk before it gives up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec

from engine.common.config import EngineConfig
from engine.common.options import option_named, pick
from engine.common.units import GiB as GiB
from engine.common.units import MiB
from engine.common.units import fmt_bytes as fmt_bytes

# Desktop reserve when a display is attached to the GPU: a compositor with two 4K
# surfaces and a browser's GPU process commonly hold 300-600 MiB; the 5% share scales
# it with cards that drive larger desktops. Headless cards need none.
DISPLAY_RESERVE_BASE_BYTES = 512 * MiB
DISPLAY_RESERVE_SHARE = 0.05
# Safety margin: the CUDA context's growth after start, allocator rounding (2 MiB
# segments) and fragmentation between block sizes.
SAFETY_MARGIN_BASE_BYTES = 128 * MiB
SAFETY_MARGIN_SHARE = 0.01
# The chunk cap is not lowered below this in suggestions or after an OOM.
MIN_PREFILL_TOKENS = 256


def reserve_for(total_bytes: int, display_attached: bool) -> int:
    """The automatic desktop reserve, in bytes: ``512 MiB + 5%`` of the card with a
    display attached, 0 without."""
    if not display_attached:
        return 0
    return DISPLAY_RESERVE_BASE_BYTES + int(DISPLAY_RESERVE_SHARE * total_bytes)


def safety_margin_for(total_bytes: int) -> int:
    """The automatic safety margin, in bytes: ``128 MiB + 1%`` of the card."""
    return SAFETY_MARGIN_BASE_BYTES + int(SAFETY_MARGIN_SHARE * total_bytes)


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as seen now, in bytes.

    ``others_bytes`` is memory held by processes other than this worker (the desktop,
    other apps, a dying predecessor). ``simulated`` marks numbers given by flags or a
    test rather than read from NVML.
    """

    name: str
    total_bytes: int
    free_bytes: int
    others_bytes: int
    display_attached: bool = False
    simulated: bool = False
    top_consumers: tuple[tuple[int, str, int], ...] = ()  # (pid, name, bytes)


@dataclass(frozen=True)
class PlanKnobs:
    """Settings that move the plan: the options of :class:`EngineConfig` of the same
    names and defaults (:meth:`of` picks them). ``None`` means automatic.

    ``device_limit`` (bytes) caps the device's total (run as if the card were
    smaller). ``max_model_len`` caps a request's context below the model's.
    ``min_context`` is the smallest context, in tokens, one request must get for the
    plan to fit (the context is lowered down to it when the card is tight; None: the
    wanted context, never lowered). ``reserve`` and ``safety_margin_bytes`` are in bytes.
    """

    page_size: int = EngineConfig.page_size
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens
    max_running_requests: int = EngineConfig.max_running_requests
    max_model_len: int | None = EngineConfig.max_model_len
    min_context: int | None = EngineConfig.min_context
    reserve: int | None = EngineConfig.reserve
    safety_margin_bytes: int | None = EngineConfig.safety_margin_bytes
    device_limit: int | None = EngineConfig.device_limit
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    cpu_experts: str = EngineConfig.cpu_experts
    tensor_parallel_size: int = EngineConfig.tensor_parallel_size

    @classmethod
    def of(cls, config: EngineConfig) -> PlanKnobs:
        """The plan's knobs of an engine config (the fields of the same names)."""
        return pick(config, cls)


@dataclass(frozen=True)
class Footprint:
    """What the model and its components need, in bytes.

    ``kv_bytes_per_token`` covers all layers, keys and values, in the KV cache's
    storage dtype ``kv_cache_dtype`` (``--kv-cache-dtype fp8``: one byte per element). ``workspace_bytes`` maps a
    component to fixed memory it declared. ``activation_peak_bytes`` is the transient
    peak of one step at the knobs' maximum chunk and batch; ``activation_source`` says
    whether it was ``"measured"`` or ``"estimated"``; ``runtime_bytes`` is the CUDA
    context (``runtime_source`` likewise). ``activation_at`` gives the peak
    for other knobs (used to price suggestions); it must agree with the peak at the
    knobs the footprint was made for. ``weight_source`` says how ``weight_bytes`` was
    counted (for a GGUF kept in block format, its type mix). ``expert_weight_bytes`` is
    the part of ``weight_bytes`` a mixture of experts' routed experts take; the ledger
    shows it on a line of its own.
    """

    weight_bytes: int
    kv_bytes_per_token: int
    vocab_size: int
    model_context_tokens: int
    workspace_bytes: tuple[tuple[str, int], ...] = ()
    sampler_bytes_per_request: int = 0
    sampler_source: str = "estimated"
    activation_peak_bytes: int = 0
    activation_source: str = "estimated"
    cuda_graph_bytes: int = 0
    scratch_bytes: int = 0
    runtime_bytes: int = 0
    runtime_source: str = "estimated"
    activation_at: Callable[[PlanKnobs], int] | None = None
    weight_source: str = "exact, from tensor shapes"
    # The routed experts' share of weight_bytes (a mixture of experts; 0 when dense),
    # over expert_layers layers of num_experts experts each.
    expert_weight_bytes: int = 0
    # A hybrid linear-attention model's recurrent and conv states of one request
    # (engine.kvcache.state_pool); the pool holds max_running_requests of them.
    state_bytes_per_request: int = 0
    # The KV cache's storage dtype as torch names it (e.g. "bfloat16", "float8_e4m3fn").
    kv_cache_dtype: str = ""
    expert_layers: int = 0
    num_experts: int = 0
    # The KV heads the cache holds (a tensor-parallel rank's share); 0 where not known.
    kv_heads: int = 0
    # The routed experts' bytes per MoE layer as stored (a GGUF's blocks may differ by
    # layer: Q4_K_M files give some layers Q6_K down blocks); empty: every layer holds
    # expert_weight_bytes / expert_layers. expert_form names a storage other than the
    # model dtype ("GGUF blocks"), which the host tier and the expert cache keep.
    expert_layer_bytes: tuple[int, ...] = ()
    expert_form: str = ""

    @property
    def expert_slot_bytes(self) -> int:
        """One routed expert's bytes (a slot of the expert cache), on average."""
        return self.expert_weight_bytes // max(self.expert_layers * self.num_experts, 1)

    def host_expert_bytes(self, host_layers: int) -> int:
        """The routed experts of the last ``host_layers`` MoE layers (those
        ``--cpu-experts`` puts in host memory), in bytes."""
        if host_layers <= 0:
            return 0
        if self.expert_layer_bytes:
            return sum(self.expert_layer_bytes[-host_layers:])
        return host_layers * (self.expert_weight_bytes // max(self.expert_layers, 1))

    def host_slot_bytes(self, host_layers: int) -> int:
        """One slot of the expert cache in front of the last ``host_layers`` MoE
        layers: their largest expert, so that slots spread over layers of different
        block types never take more than the plan charged."""
        if host_layers > 0 and self.expert_layer_bytes and self.num_experts:
            return max(-(-b // self.num_experts) for b in self.expert_layer_bytes[-host_layers:])
        return self.expert_slot_bytes


class LedgerEntry(msgspec.Struct, frozen=True):
    """One line of the ledger: ``sign`` is ``+`` for what the device offers, ``-`` for
    what is taken from it, ``=`` for a subtotal."""

    name: str
    bytes: int
    sign: str
    source: str


class Suggestion(msgspec.Struct, frozen=True):
    """A setting that would make the plan fit (or fit better): ``flag`` from ``current``
    to ``proposed`` frees ``saves_bytes``."""

    flag: str
    current: str
    proposed: str
    saves_bytes: int
    price: str = ""  # what the setting costs besides memory ("" when nothing)

    def text(self) -> str:
        cost = f" ({self.price})" if self.price else ""
        return f"{self.flag} {self.current} → {self.proposed} frees about {fmt_bytes(self.saves_bytes)}{cost}"


class MemoryPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The ledger and what it gives. Sizes in bytes, contexts in tokens.

    ``wanted_context_tokens`` is the context asked for (the model's, capped by
    ``--max-model-len``); ``max_context_tokens`` what one request gets (lower when the
    pool cannot hold the wanted one); ``context_note`` says why it is lower ("" when it
    is not). ``kv_bytes_per_token`` is what one token of context costs in the KV cache
    (all layers, keys and values) in its storage dtype ``kv_cache_dtype``.
    """

    device: str
    simulated: bool
    ledger: list[LedgerEntry]
    budget_bytes: int
    fixed_bytes: int  # everything but the KV pool charged against the budget
    kv_pool_bytes: int
    num_pages: int  # usable pages (the pool allocates one more: the null page)
    page_size: int
    max_context_tokens: int
    min_context_tokens: int
    fits: bool
    shortfall_bytes: int
    suggestions: list[Suggestion]
    max_prefill_tokens: int
    max_running_requests: int
    wanted_context_tokens: int = 0
    context_note: str = ""
    kv_cache_dtype: str = ""  # the KV cache's storage dtype, e.g. "bfloat16", "float8_e4m3fn"
    kv_bytes_per_token: int = 0  # all layers, keys and values, in that dtype
    # Hybrid placement: layers whose routed experts live in host memory, and the
    # device expert cache in front of them (whole slots of expert_slot_bytes).
    cpu_expert_layers: int = 0
    expert_cache_slots: int = 0
    expert_slot_bytes: int = 0
    # Tensor parallel: this is one rank's plan of this many (weights, KV heads and pool
    # split as the ranks hold them); every rank's GPU needs it. kv_heads: the KV heads
    # the cache holds (a rank's), 0 where not known.
    tensor_parallel_size: int = 1
    kv_heads: int = 0

    def after_resize(self, num_pages: int, kv_pool_bytes: int, max_context_tokens: int, reason: str) -> MemoryPlan:
        """This plan once the KV pool was resized while serving to ``num_pages`` usable
        pages of ``kv_pool_bytes``, giving ``max_context_tokens`` per request:
        ``context_note`` says the context grew back (or shrank) and why (``reason``),
        "" once it is the wanted one again. The ledger keeps the start's lines."""
        note = ""
        if max_context_tokens < self.wanted_context_tokens:
            note = f"context {self.wanted_context_tokens:,} -> {max_context_tokens:,} tokens: {reason}"
        return msgspec.structs.replace(self, num_pages=num_pages, kv_pool_bytes=kv_pool_bytes,
                                       max_context_tokens=max_context_tokens, context_note=note)

    @property
    def context_lowered(self) -> bool:
        """The plan fits, with a context below the one asked for."""
        return self.fits and self.max_context_tokens < self.wanted_context_tokens

    def message(self) -> str:
        """What does not fit, by how much, and what fixes it (empty when it fits)."""
        if self.fits:
            return ""
        lines = [
            f"the memory plan does not fit on {self.device}: one request of "
            f"{self.min_context_tokens} tokens needs {fmt_bytes(self.shortfall_bytes)} more "
            f"than the budget of {fmt_bytes(self.budget_bytes)} leaves for the KV cache."
        ]
        enough = [s for s in self.suggestions if s.saves_bytes >= self.shortfall_bytes]
        if enough:
            lines.append("Any one of these settings fixes it:")
            lines.extend(f"  {s.text()}" for s in enough)
        partial = [s for s in self.suggestions if s.saves_bytes < self.shortfall_bytes]
        if partial:
            lines.append("These help but are not enough alone:" if enough else "These settings help; combine them:")
            lines.extend(f"  {s.text()}" for s in partial)
        if not enough and sum(s.saves_bytes for s in self.suggestions) < self.shortfall_bytes:
            lines.append("Even together they do not free enough: use a smaller model or a larger device.")
        return "\n".join(lines)

    def table(self) -> str:
        """The ledger as aligned text, MiB at the edge."""
        width = max(len(e.name) for e in self.ledger)
        out = []
        for e in self.ledger:
            mark = {"+": " ", "-": "-", "=": "="}[e.sign]
            out.append(f"{mark} {e.name:<{width}}  {e.bytes / MiB:>10.1f} MiB   {e.source}")
        out.append(
            f"  {'KV pages':<{width}}  {self.num_pages:>10d}        x {self.page_size} tokens; "
            f"max context {self.max_context_tokens} tokens"
        )
        if self.context_note:
            out.append(f"  {self.context_note}")
        return "\n".join(out)


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


def _weight_lines(fp: Footprint, host_layers: int) -> list[LedgerEntry]:
    """``weights``, and for a mixture of experts the routed experts apart from the rest
    (attention, router, shared experts, embeddings); the routed experts of
    ``host_layers`` layers live in host memory, not here."""
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


def _ledger(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint) -> MemoryPlan:
    host = host_expert_layers(knobs, fp)
    if host is not None:
        return _ledger_at(device, knobs, fp, host)
    # auto: the fewest offloaded layers that fit; all of them when none does.
    for layers in range(fp.expert_layers + 1):
        plan = _ledger_at(device, knobs, fp, layers)
        if plan.fits:
            return plan
    return plan


def _ledger_at(device: DeviceMemory, knobs: PlanKnobs, fp: Footprint, host_layers: int) -> MemoryPlan:
    if min(device.total_bytes, device.free_bytes, device.others_bytes, fp.weight_bytes) < 0:
        raise ValueError("memory sizes must be >= 0")
    total = device.total_bytes
    if knobs.device_limit is not None:
        total = min(total, knobs.device_limit)
    reserve = knobs.reserve if knobs.reserve is not None else reserve_for(total, device.display_attached)
    margin = knobs.safety_margin_bytes if knobs.safety_margin_bytes is not None else safety_margin_for(total)
    src = "simulated" if device.simulated else "NVML"
    reserve_src = _flag("reserve") if knobs.reserve is not None else (
        "auto: display attached" if device.display_attached else "auto: no display"
    )
    budget = total - device.others_bytes - reserve - margin
    sampler = fp.sampler_bytes_per_request * knobs.max_running_requests
    activation = fp.activation_at(knobs) if fp.activation_at is not None else fp.activation_peak_bytes
    ledger = [
        LedgerEntry("device total", total, "+", src + (" (a card of --device-limit)" if total < device.total_bytes else "")),
        LedgerEntry("used by other processes", device.others_bytes, "-", src + ", now"),
        LedgerEntry("desktop reserve", reserve, "-", reserve_src),
        LedgerEntry("safety margin", margin, "-", "auto" if knobs.safety_margin_bytes is None else "flag"),
        LedgerEntry("budget", budget, "=", ""),
        *_weight_lines(fp, host_layers),
        LedgerEntry("CUDA context and runtime", fp.runtime_bytes, "-", fp.runtime_source if fp.runtime_bytes else "none"),
    ]
    ledger += [LedgerEntry(f"workspace: {name}", b, "-", "declared") for name, b in fp.workspace_bytes]
    ledger += [
        LedgerEntry("sampler and logits", sampler, "-", f"{fp.sampler_source}, {knobs.max_running_requests} requests x vocab {fp.vocab_size}"),
        LedgerEntry("prefill activation peak", activation, "-", f"{fp.activation_source} at {knobs.max_prefill_tokens} tokens"
                    + (", linear-attention layers included" if fp.state_bytes_per_request else "")),
        LedgerEntry("CUDA graph pool", fp.cuda_graph_bytes, "-", "measured at capture" if fp.cuda_graph_bytes else "none captured"),
        LedgerEntry("model scratch", fp.scratch_bytes, "-", "measured" if fp.scratch_bytes else "none"),
    ]
    # One slot per running request, plus the null slot (engine.kvcache.state_pool).
    states = fp.state_bytes_per_request * (knobs.max_running_requests + 1)
    if fp.state_bytes_per_request:
        ledger.append(LedgerEntry("linear-attention state pool", states, "-",
                                  f"exact, {knobs.max_running_requests} requests + 1 null slot x "
                                  f"{fmt_bytes(fp.state_bytes_per_request)}"))
    fixed = (fp.weight_bytes + fp.runtime_bytes + sum(b for _, b in fp.workspace_bytes) + sampler + activation
             + fp.cuda_graph_bytes + fp.scratch_bytes + states)
    page_bytes = fp.kv_bytes_per_token * knobs.page_size
    model_ctx = fp.model_context_tokens if knobs.max_model_len is None else min(fp.model_context_tokens, knobs.max_model_len)
    min_ctx = min(knobs.min_context or model_ctx, model_ctx)
    need_pages = math.ceil(min_ctx / knobs.page_size)
    slots = 0
    slot = fp.host_slot_bytes(host_layers)
    if host_layers > 0:
        fixed -= fp.host_expert_bytes(host_layers)
        spare = budget - fixed - need_pages * page_bytes
        slots = int(min(max(spare // 2, 0) // slot, host_layers * fp.num_experts)) if slot > 0 else 0
        fixed += slots * slot
        form = f" ({fp.expert_form})" if fp.expert_form else ""
        ledger.append(LedgerEntry("expert cache", slots * slot, "-",
                                  f"{slots} slots of {fmt_bytes(slot)}{form} for {host_layers} layers x "
                                  f"{fp.num_experts} experts in host memory"))
    kv_room = budget - fixed
    pages = max(kv_room // page_bytes, 0) if page_bytes > 0 else 0
    kv_bytes = pages * page_bytes
    ledger.append(LedgerEntry("KV cache pool", kv_bytes, "=", f"{pages} pages of {fmt_bytes(page_bytes)}"
                                                     + (f", {fp.kv_cache_dtype}" if fp.kv_cache_dtype else "")))
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
        kv_bytes_per_token=fp.kv_bytes_per_token,
        num_pages=int(pages),
        page_size=knobs.page_size,
        max_context_tokens=max_ctx,
        min_context_tokens=min_ctx,
        fits=fits,
        shortfall_bytes=0 if fits else int(need_pages * page_bytes - kv_room),
        suggestions=[],
        max_prefill_tokens=knobs.max_prefill_tokens,
        max_running_requests=knobs.max_running_requests,
        wanted_context_tokens=model_ctx,
        context_note=note,
        cpu_expert_layers=host_layers,
        expert_cache_slots=slots,
        expert_slot_bytes=slot if host_layers else 0,
        tensor_parallel_size=knobs.tensor_parallel_size,
        kv_heads=fp.kv_heads,
    )


def fit_plan(planner: Callable[[PlanKnobs], MemoryPlan], knobs: PlanKnobs) -> tuple[MemoryPlan, PlanKnobs]:
    """Plan with ``knobs``; when that cannot hold one request of ``--min-context``,
    halve the prefill chunk (floor ``MIN_PREFILL_TOKENS``) until it can. A plan that fits
    with a lowered context keeps its chunk: a smaller chunk slows every prompt's prefill
    and frees little where the context-long terms of the activation peak dominate,
    while a lowered context only refuses the longest prompts, and grows back with the
    pool.

    Returns:
        (the plan, the knobs it was made with). When nothing fits, the plan at the
        configured knobs (``fits`` False: its message prices the fixes) and ``knobs``.
    """
    first = plan = planner(knobs)
    tried = knobs
    while not plan.fits and tried.max_prefill_tokens > MIN_PREFILL_TOKENS:
        tried = replace(tried, max_prefill_tokens=max(tried.max_prefill_tokens // 2, MIN_PREFILL_TOKENS))
        plan = planner(tried)
    if not plan.fits:
        return first, knobs
    return plan, tried


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
    if running > 1:
        fewer = max(running // 4, 1)
        candidates.append((_flag("max_running_requests"), str(running), str(fewer), replace(knobs, max_running_requests=fewer)))
    ctx = plan.min_context_tokens
    if ctx > 512:
        shorter = max(ctx // 4, 512)
        candidates.append((_flag("min_context"), str(ctx), str(shorter), replace(knobs, min_context=shorter)))
    reserve = next(e.bytes for e in plan.ledger if e.name == "desktop reserve")
    if reserve > 0:
        lower = reserve // 2
        candidates.append((_flag("reserve"), fmt_bytes(reserve), fmt_bytes(lower), replace(knobs, reserve=lower)))
    host = host_expert_layers(knobs, fp)
    if host is not None and host < fp.expert_layers:
        for more in sorted({min(max(host * 2, 1), fp.expert_layers), fp.expert_layers}):
            candidates.append((_flag("cpu_experts"), knobs.cpu_experts, str(more), replace(knobs, cpu_experts=str(more))))
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
        s = Suggestion(flag, cur, new, int(saved), price)
        held = best.get(flag)
        if held is None or _better((other.fits, s), held):
            best[flag] = (other.fits, s)
    ranked = sorted(best.values(), key=lambda fs: (not fs[0], -fs[1].saves_bytes))
    suggestions = [s for _, s in ranked][:3]
    if device.others_bytes > 0:
        suggestions.append(Suggestion("close other GPU applications", fmt_bytes(device.others_bytes), "0", device.others_bytes))
    return suggestions


def _better(a: tuple[bool, Suggestion], b: tuple[bool, Suggestion]) -> bool:
    if a[0] != b[0]:
        return a[0]
    # Both fit: the smaller change; neither fits: the larger saving.
    return a[1].saves_bytes < b[1].saves_bytes if a[0] else a[1].saves_bytes > b[1].saves_bytes
