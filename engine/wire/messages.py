"""Typed records exchanged with the engine: requests in, token outputs out.

Torch-free msgspec structs, so the service can build them and they cross the process
boundary as msgpack. The in-process API (``Engine.add_request`` / ``Engine.step``) uses
the same records, so a CLI run and a served run see identical types.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.memory.plan import MemoryPlan


class ThinkingBudget(msgspec.Struct, frozen=True, kw_only=True):
    """A cap on a reasoning model's thinking block (:mod:`engine.sampling.thinking`).

    ``tokens``: the most tokens the sequence may write inside its block; once it has
    written that many without closing it, ``close_ids`` (the template's ``</think>``)
    are forced as its next tokens and the answer goes on after them. ``open_ids``: the
    tokens that open the block; empty when the prompt opened it (the answer starts
    inside). Only the sequence's first block counts.
    """

    tokens: int
    close_ids: tuple[int, ...]
    open_ids: tuple[int, ...] = ()


# Temperatures below this sample greedily (vLLM's bound, 1e-5): dividing float32 logits by
# a smaller one overflows every gap to -inf, and one that rounds to 0 in float32 (below
# about 1e-45) made the best token 0/0 = NaN and the whole row unusable.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick the next token and when to stop.

    ``temperature`` below :data:`GREEDY_TEMPERATURE` (0 included) means greedy.
    ``top_k <= 0`` disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` gives the request its own random
    stream, so its output does not depend on what else runs in the batch.
    ``repetition_penalty`` follows CTRL (Keskar et al., 2019, as in transformers):
    positive logits of seen tokens are divided by it, negative ones multiplied.
    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI's definition: subtract
    ``presence * (count > 0) + frequency * count`` over generated tokens.
    ``max_new_tokens`` counts generated tokens; ``stop_token_ids`` end the request like
    EOS does (the stop token is part of the output ids, not of the text).
    ``logit_bias``: OpenAI's, as ``(token id, bias)`` pairs added to the raw logits
    before everything else (a bias of -100 bans a token in practice, +100 forces it).
    ``json_schema``: JSON text of a JSON Schema the answer must match (structured
    output, :mod:`engine.sampling.grammar`).
    ``logprobs``: None (none wanted, no cost), or ``k`` in 0..:data:`MAX_LOGPROBS`:
    each generated token comes with its log-probability and the ``k`` most likely
    tokens' (:class:`TokenLogprobs`). ``prompt_logprobs``: the same for every prompt
    token after the first (OpenAI's ``echo``); such a request skips the prefix cache
    and prefills in chunks of at most :data:`SCORED_CHUNK_TOKENS` tokens.
    ``thinking``: a :class:`ThinkingBudget`, or None for no cap on reasoning.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    thinking: ThinkingBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


# OpenAI's bound on top_logprobs.
MAX_LOGPROBS = 20
# Largest prefill chunk of a request whose prompt is scored: each of its tokens makes a
# row of ``V`` float32 logits (4 * V bytes, 0.6 MB at a 150k vocabulary).
SCORED_CHUNK_TOKENS = 256


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One token's log-probability and the ``k`` most likely alternatives at its
    position (natural log, float32 precision), most likely first.

    Which distribution: the log-softmax of the logits the token was sampled from after
    ``logit_bias`` and the grammar mask, before penalties, temperature and the top-k,
    top-p and min-p filters (so a token the grammar forbids has ``-inf``, and the
    ranking is the model's, not cut by the filters). Prompt tokens: the model's
    log-softmax at the position before them.
    """

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class GenerateRequest(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A new request: prompt token ids (already templated and tokenized). ``group``: the
    call it is one sequence of (OpenAI's ``n``, a completion's prompts; the same text for
    each of them), so that one call cannot hold every decode slot while another waits
    (:mod:`engine.scheduler.fair_share`); empty for a call of one sequence."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    group: str = ""


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    """Stop a request at whatever state it is in and free its pages."""

    request_id: str


# finish_reason values, OpenAI's where they exist.
FINISH_STOP = "stop"  # EOS or a stop token id (stop strings are the service's)
FINISH_LENGTH = "length"  # max_new_tokens or the context limit
FINISH_ABORT = "abort"  # aborted by the caller
FINISH_ERROR = "error"  # failed; ``error_code`` says why
# error_code of a request whose JSON schema did not compile (unsupported, or not within
# engine.sampling.grammar.COMPILE_TIMEOUT_S): the caller's fault, not the engine's.
ERROR_INVALID_SCHEMA = "invalid_schema"
# error_code of a request whose logits could not be sampled from (NaN, +inf, every token
# -inf after penalties): it fails alone, the step's other requests go on.
ERROR_INVALID_LOGITS = "invalid_logits"


class TokenOutput(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """New tokens of one request from one engine step.

    ``token_ids`` are the tokens generated since the last output (usually one).
    ``finished`` is set once; then ``finish_reason`` is one of the ``FINISH_*`` values
    and, for ``"error"``, ``error_code`` (e.g. ``"out_of_memory"``) and ``error_message``.
    ``prompt_tokens`` / ``cached_tokens`` are the prompt length and how much of it came
    from the prefix cache. ``logprobs``: one :class:`TokenLogprobs` per token of
    ``token_ids`` when the request asked (``SamplingParams.logprobs``), else None.
    ``prompt_logprobs``: with the request's first output, when it asked
    (``SamplingParams.prompt_logprobs``): one entry per prompt token, the first None.
    """

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Facts about a loaded engine, sent once in the worker's readiness message.

    ``max_context_tokens`` is what one request can really use: the smaller of the model's
    context length and what the KV pool holds for one request. Sizes are in bytes.
    ``num_pages`` is the KV pool's usable pages (its null page apart,
    :func:`engine.memory.kv_fit.usable_pages`), as the plan, the engine's counters
    (``total_pages``), replan events, the control API and the log count them;
    ``kv_cache_bytes`` their bytes, as the plan's ``kv_pool_bytes`` counts them (a
    sliding-window ring pool apart). ``kv_buffer_bytes`` is every buffer the KV cache
    holds: the KV pool's null page and a sliding-window ring pool (with its own null
    page) included.
    """

    model_name: str
    model_dir: str
    architecture: str
    vocab_size: int
    max_context_tokens: int
    model_context_tokens: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    page_size: int
    num_pages: int
    kv_cache_bytes: int
    weight_bytes: int
    max_prefill_tokens: int
    max_running_requests: int
    plan: MemoryPlan | None = None  # None when the pool size was fixed (no plan made)
    # The KV cache's storage dtype (e.g. "bfloat16", "float8_e4m3fn") and what one token
    # of context costs in it (all layers, keys and values; a rank's with tensor
    # parallel): known on every device, a CPU's fixed pool included, where no plan is.
    kv_cache_dtype: str = ""
    kv_bytes_per_token: int = 0
    kv_buffer_bytes: int = 0
    # The model's parameters, counted from its shapes whatever their storage, and the
    # block type most of the quantized projections keep (e.g. "Q4_1"; "" when the
    # weights are held in ``dtype``).
    parameter_count: int = 0
    weight_format: str = ""


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Engine counters at one instant."""

    running: int
    waiting: int
    free_pages: int
    total_pages: int
    cached_pages: int
    prefix_hit_tokens: int
    prefix_lookup_tokens: int
    finished: int
    aborted: int
    failed: int
    # Routed experts in host memory (--cpu-experts), totals since start: expert-steps
    # served from the GPU expert cache, missing from it, experts copied in, expert-steps
    # run on the CPU, expert-steps a decode step read from host memory over the bus; and
    # the cache's slots now. All 0 when every expert is on the device.
    expert_cache_hits: int = 0
    expert_cache_misses: int = 0
    expert_copies: int = 0
    expert_cpu_runs: int = 0
    expert_bus_reads: int = 0
    expert_cache_slots: int = 0


# OomEvent.phase values: where the step ran out of memory.
OOM_PHASE_PREFILL = "prefill"  # the forward of a step with at least one prefill chunk
OOM_PHASE_DECODE = "decode"  # the forward of a step of decodes only
OOM_PHASE_SAMPLE = "sample"  # sampling, after the forward

# OomEvent.action values: what the engine did about it.
OOM_RETRY_SMALLER_CHUNK = "retry_smaller_chunk"  # the request's chunk cap was halved
OOM_PREEMPTED = "preempted"  # sent back to wait and be recomputed when memory allows
OOM_RETRY = "retry"  # it ran (nearly) alone at its smallest size: run it again as is
OOM_FAILED = "failed"  # ended with error_code "out_of_memory"


class OomEvent(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A step ran out of device memory; it was rolled back and ``request_id`` got
    ``action``. Every other request of the step simply runs again.

    ``tokens_in_step`` counts the new tokens the failed step fed the model.
    ``message`` is for people: the sizes involved and the allocator's own words.
    """

    request_id: str
    phase: str
    tokens_in_step: int
    action: str
    message: str


class ReplanWanted(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The engine ran out of memory at run time and lowered its prefill chunk cap to
    ``new_max_prefill_tokens``: the memory plan no longer matches the device (another
    process took memory, or a transient was not budgeted) and should be made again."""

    reason: str
    new_max_prefill_tokens: int


# Who asked for a live change of memory use: the service's VRAM watcher (another
# process took or freed device memory) or a person through the control API.
ReplanOrigin = Literal["watcher", "control"]
BY_WATCHER: ReplanOrigin = "watcher"
BY_CONTROL: ReplanOrigin = "control"

# Replanned.action values: what changed.
REPLAN_RESIZE_POOL = "resize_pool"  # the KV pool was shrunk or grown
REPLAN_PREFILL_CHUNK = "prefill_chunk"  # the engine-wide prefill chunk cap was set
REPLAN_EVICT_PREFIX_CACHE = "evict_prefix_cache"  # unreferenced prefix-cache pages were freed
REPLAN_RESIZE_EXPERT_CACHE = "resize_expert_cache"  # the GPU expert cache was shrunk or grown
REPLAN_MOVE_LAYERS = "move_layers"  # --cpu-layers auto: decoder layers moved between the device and the CPU


class PoolChange(msgspec.Struct, frozen=True, kw_only=True):
    """The KV pool's figures around one live change of the engine's memory use.

    Pages count the whole pool, the null page included (``EngineInfo.num_pages`` is
    :func:`engine.memory.kv_fit.usable_pages` of ``after_pages``);
    bytes are the pool's buffers. ``evicted_pages`` left the prefix cache,
    ``relocated_pages`` had their keys and values moved below the cut; ``preempted``
    requests were sent back to wait and be recomputed (youngest first), ``ended`` ones
    no longer fit in the new context limit and ended (see ``Engine.resize_kv_pool``).
    ``max_context_tokens`` is the per-request limit after the change, ``duration_ms``
    how long the change took. ``before_ring_pages``/``after_ring_pages`` are the
    sliding-window ring pool's pages (null page included; 0 without one), which a KV pool
    resize resizes too (:class:`engine.memory.kv_fit.RingRule`); ``before_bytes`` and
    ``after_bytes`` count both pools' buffers (what the device holds).
    ``before_kv_pool_bytes``/``after_kv_pool_bytes`` are the KV pool's usable pages'
    bytes (``KVPool.usable_bytes``): what the plan's, ``EngineInfo.kv_cache_bytes`` and
    the replan events' ``kv_pool_bytes`` count.
    """

    before_pages: int
    after_pages: int
    before_bytes: int
    after_bytes: int
    before_kv_pool_bytes: int = 0
    after_kv_pool_bytes: int = 0
    before_ring_pages: int = 0
    after_ring_pages: int = 0
    evicted_pages: int = 0
    relocated_pages: int = 0
    preempted: list[str] = msgspec.field(default_factory=list)
    ended: list[str] = msgspec.field(default_factory=list)
    max_context_tokens: int = 0
    duration_ms: float = 0.0


class ResizeResult(PoolChange, frozen=True, kw_only=True):
    """What one live KV pool resize did (``Engine.resize_kv_pool``): the
    :class:`PoolChange` fields."""


class Replanned(PoolChange, frozen=True, tag=True, kw_only=True):
    """The engine changed its memory use while running (another process took or freed
    device memory, or a person asked): ``action`` is one of the ``REPLAN_*`` values, asked
    for by ``origin`` (:data:`ReplanOrigin`) with ``reason`` (for people).

    The KV pool's figures are :class:`PoolChange`'s (sizes equal unless the pool was
    resized; for an eviction, ``evicted_pages`` is what was freed); ``max_prefill_tokens``
    and ``max_context_tokens`` are the limits after the change, both always set.

    ``before_expert_slots`` / ``after_expert_slots`` and ``before_expert_bytes`` /
    ``after_expert_bytes``: the GPU expert cache of the routed experts in host memory
    (``--cpu-experts``), slots over all such layers and their device bytes; equal unless
    it was resized (``REPLAN_RESIZE_EXPERT_CACHE``), all 0 without one.

    ``before_cpu_layers`` / ``after_cpu_layers``: the last decoder layers the CPU runs
    (``--cpu-layers``), equal unless the split moved (``REPLAN_MOVE_LAYERS``);
    ``moved_bytes`` the device bytes that move gave back (negative: took), weights and
    KV together; ``plan`` the memory plan after it (the split, its note, the device's
    fixed and KV bytes now), None for the other actions and an engine without a plan.
    """

    action: str
    reason: str
    origin: ReplanOrigin = BY_WATCHER
    max_prefill_tokens: int
    max_context_tokens: int
    duration_ms: float
    before_expert_slots: int = 0
    after_expert_slots: int = 0
    before_expert_bytes: int = 0
    after_expert_bytes: int = 0
    before_cpu_layers: int = 0
    after_cpu_layers: int = 0
    moved_bytes: int = 0
    plan: MemoryPlan | None = None


EngineEvent = OomEvent | ReplanWanted | Replanned
