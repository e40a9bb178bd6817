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
says by how much and which settings fix it; :func:`~engine.memory.ledger.fit_plan` lowers the prefill
chunk before it gives up.

This module holds the plan's records and the reserves; the arithmetic that fills them is
:mod:`engine.memory.ledger`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from engine.common.config import EngineConfig
from engine.common.options import pick
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
    # The host's available memory (Linux's MemAvailable), which --cpu-layers draws on;
    # None where not known.
    host_available_bytes: int | None = None
    top_consumers: tuple[tuple[int, str, int], ...] = ()  # (pid, name, bytes)


# A hybrid model's prefix cache keeps the linear layers' states after a cached prefix in
# checkpoint slots beside the running requests' (each as large as one request's states:
# tens of MiB for a 30B-class model); this many at most, reused least recently used first.
MAX_STATE_CHECKPOINTS = 8


# The prefill chunk where --max-prefill-tokens is unset. A step's time is what every other
# running request waits for its next token: a GPU prefills 2,048 tokens in tens of
# milliseconds, a CPU's 2 cores take 3-13 s for them (a 20-token reply beside a 7,200-token
# prompt took 23.8 s at 2,048, 6.9 s at 256, the long prompt itself no slower: 25.3 / 23.7 s),
# and the CPU's products are as fast at 256 rows as at 2,048.
PREFILL_CHUNK_GPU = 2048
PREFILL_CHUNK_CPU = 256


def prefill_chunk(device_type: str) -> int:
    """The prefill chunk, in tokens, of an engine on ``device_type`` ("cpu" or a GPU's)
    when ``--max-prefill-tokens`` is unset."""
    return PREFILL_CHUNK_CPU if device_type == "cpu" else PREFILL_CHUNK_GPU


# The running requests where --max-running-requests is unset: this many, or as many as the
# card holds (engine.memory.plan_fit lowers them; a number a person gave is not lowered).
RUNNING_REQUESTS = 64


def running_requests(config: EngineConfig) -> int:
    """``config``'s ``--max-running-requests``, :data:`RUNNING_REQUESTS` where unset."""
    return RUNNING_REQUESTS if config.max_running_requests is None else config.max_running_requests


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
    max_prefill_tokens: int = PREFILL_CHUNK_GPU
    max_running_requests: int = RUNNING_REQUESTS
    max_model_len: int | None = EngineConfig.max_model_len
    min_context: int | None = EngineConfig.min_context
    reserve: int | None = EngineConfig.reserve
    safety_margin_bytes: int | None = EngineConfig.safety_margin_bytes
    device_limit: int | None = EngineConfig.device_limit
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    cpu_experts: str = EngineConfig.cpu_experts
    cpu_layers: str = EngineConfig.cpu_layers
    tensor_parallel_size: int = EngineConfig.tensor_parallel_size
    prefix_cache: bool = EngineConfig.prefix_cache
    sliding_kv_ring: str = EngineConfig.sliding_kv_ring
    attention_backend: str = EngineConfig.attention_backend

    @property
    def state_checkpoints(self) -> int:
        """Slots a hybrid model's state pool keeps for the prefix cache's checkpoints
        (:mod:`engine.kvcache.state_pool`): one per running request up to
        :data:`MAX_STATE_CHECKPOINTS`, none without the prefix cache."""
        return min(self.max_running_requests, MAX_STATE_CHECKPOINTS) if self.prefix_cache else 0

    @classmethod
    def of(cls, config: EngineConfig, device_type: str | None = None) -> PlanKnobs:
        """The plan's knobs of an engine config (the fields of the same names), an unset
        prefill chunk by :func:`prefill_chunk` for ``device_type`` ("cpu", "cuda"; None:
        as ``config.device`` names it, "auto" counted as a GPU), a simulated card's as a
        GPU's."""
        chunk = config.max_prefill_tokens
        if chunk is None:
            device_type = device_type or ("cpu" if config.device == "cpu" else "cuda")
            # A simulated card (--device-total) plans as the GPU it stands for.
            chunk = prefill_chunk("cuda" if config.device_total is not None else device_type)
        return pick(config, cls, max_prefill_tokens=chunk, max_running_requests=running_requests(config))



@dataclass(frozen=True)
class Footprint:
    """What the model and its components need, in bytes.

    ``kv_bytes_per_token`` covers all layers (but those of a sliding-window ring,
    ``kv_ring_pages``), keys and values, in the KV cache's
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
    # Sliding-window layers' KV, in words for the ledger's KV line (empty without them).
    kv_window_note: str = ""
    # Sliding-window layers that keep only their window (engine.kvcache.ring): one ring
    # page's bytes over those layers, and at given knobs (the pages the rings of
    # max_running_requests hold at most, the pages of the prefix cache's checkpoints,
    # the pages of one ring between steps);
    # the ring pool holds min(the sum, KV pool pages) pages and its null page
    # (engine.memory.ledger prices it). kv_bytes_per_token then covers the other layers
    # only. 0 and None without a ring.
    kv_ring_page_bytes: int = 0
    kv_ring_pages: Callable[[PlanKnobs], tuple[int, int, int]] | None = None
    # A dense model whose last decoder layers may run on the CPU (--cpu-layers): each
    # layer's weights on the device and in host memory (the CPU path's layout), and one
    # token's keys and values of one layer in the host pool; empty for a model that
    # cannot split (engine.core.settings_fit.splittable).
    layer_bytes: tuple[int, ...] = ()
    host_layer_bytes: tuple[int, ...] = ()
    host_kv_bytes_per_token_layer: int = 0

    def moved_bytes(self, cpu_layers: int) -> tuple[int, int]:
        """``(device, host)``: the weight bytes the last ``cpu_layers`` decoder layers take
        on the device, and in host memory once moved there."""
        if cpu_layers <= 0:
            return 0, 0
        return sum(self.layer_bytes[-cpu_layers:]), sum(self.host_layer_bytes[-cpu_layers:])

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
    # Pages of the sliding-window ring pool (engine.kvcache.ring), its null page apart; 0
    # without one. The engine's ring pool holds no more (engine.memory.kv_fit).
    kv_ring_pages: int = 0
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
    # A dense model's last decoder layers run by the CPU (--cpu-layers), their weights
    # and KV in host memory; split_note prices it in words ("" without a split).
    cpu_layers: int = 0
    split_note: str = ""
    # A hybrid model's recurrent and conv states of one request (0 for others), and why
    # the running requests are fewer than --max-running-requests' default ("not 64: the
    # card cannot hold more; ..."; "" when they are not lowered).
    state_bytes_per_request: int = 0
    requests_note: str = ""

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
        if self.budget_bytes < 0:
            # No budget at all: other processes, the reserve and the margin take more
            # than the device has (a negative budget reads as nonsense).
            first = (f"the memory plan does not fit on {self.device}: its budget does not fit, "
                     f"{fmt_bytes(-self.budget_bytes)} short (other processes, the desktop reserve and the "
                     f"safety margin take more than the device has); one request of {self.min_context_tokens} "
                     f"tokens needs {fmt_bytes(self.shortfall_bytes)} more than the device has left.")
        else:
            first = (f"the memory plan does not fit on {self.device}: one request of "
                     f"{self.min_context_tokens} tokens needs {fmt_bytes(self.shortfall_bytes)} more "
                     f"than the budget of {fmt_bytes(self.budget_bytes)} leaves for the KV cache.")
        lines = [first]
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
        if self.split_note:
            out.append(f"  {self.split_note}")
        return "\n".join(out)


