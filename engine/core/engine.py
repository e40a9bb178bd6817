"""The engine facade: load a model, plan its memory, size the KV pool, run steps.

Used in-process by ``headroom generate`` and by the worker process of ``headroom serve``.
The constructor reads top to bottom: device and dtype, model config, memory plan
(before any weight loads), weights, profile run, KV pool, attention backend, prefix
cache, scheduler. A step is schedule -> forward -> commit.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import RequestRejected
from engine.common.options import pick
from engine.core.footprint import kv_bytes_per_token, kv_ring_excluded
from engine.core.grammar_waits import GrammarWaits
from engine.core.live_replan import LiveReplan
from engine.core.outputs import keep_logprobs, token_output
from engine.core.plan_stages import PlanStages
from engine.core.profile import measure_step_peak, warm_up_fresh_prompts
from engine.core.runner import ModelRunner
from engine.core.settings_fit import check_for_model
from engine.core.split_replan import SplitReplan
from engine.core.startup import (
    device_memory,
    estimated_planner,
    resolve_device,
    resolve_dtype,
    use_kernel_switches,
    weight_format,
)
from engine.core.tp_follow import lead
from engine.core.weights_stage import WeightsStage
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.pool import kv_storage_dtype
from engine.kvcache.radix import RadixCache
from engine.kvcache.ring import RingPages
from engine.kvcache.state_pool import StatePool
from engine.layers.attention.registry import resolve_backend_name
from engine.layers.moe.offload import resize_cache
from engine.layers.weight_census import model_weight_bytes, quantized_format
from engine.loader.default_model import model_display_name
from engine.loader.hf_config import load_model_config
from engine.loader.resolve import resolve_model
from engine.loader.weight_size import parameter_count
from engine.memory.kv_fit import usable_pages
from engine.memory.plan import MemoryPlan, PlanKnobs
from engine.parallel.group import TensorParallel
from engine.parallel.shard import rank_config as shard_rank_config
from engine.sampling.grammar import GrammarError
from engine.sampling.state import SamplingState
from engine.scheduler.request import Request
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.wire.messages import (
    ERROR_INVALID_LOGITS,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    TokenOutput,
)
from kernels.attention.kv_store import kv_dtype_name

log = logging.getLogger("headroom.engine")


class Engine(PlanStages, WeightsStage, GrammarWaits, LiveReplan, SplitReplan):
    """One model on one device, serving many requests by continuous batching.

    Single-threaded: call every method from one thread. The live replans (resize the KV
    pool, set the prefill chunk cap, evict the prefix cache) are
    :class:`engine.core.live_replan.LiveReplan`'s; moving a split model's boundary
    (``--cpu-layers auto``) is :class:`engine.core.split_replan.SplitReplan`'s.

    Raises (constructor): the loader's ``ModelLoadError`` subclasses for a missing or
    broken model; :class:`PlanDoesNotFit` when the memory plan cannot hold one request
    of the minimum context (raised before the weights load where the sizes show it);
    ``ValueError`` for a bad config value or a tensor-parallel size without ``tp``;
    :class:`engine.common.errors.SettingRefused` (a ``ValueError``) for a setting the model
    cannot honour (:mod:`engine.core.settings_fit`).
    """

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        if config.tensor_parallel_size > 1 and tp is None:
            raise ValueError(
                f"--tensor-parallel-size {config.tensor_parallel_size} runs the engine as a group of rank "
                "processes: build it with engine.worker.tp_launch.parallel_engine (headroom serve does), "
                "or use --tensor-parallel-size 1"
            )
        self.config = config
        # The kernel switches (--quant-int8, --pdl, ...) before any weight is loaded or
        # kernel launched: the loader's repacking and the kernels read them.
        use_kernel_switches(config)
        # A rank of a tensor-parallel group (engine.parallel): this engine holds its
        # shard; rank 0's schedules and broadcasts, the others follow.
        self.tp = tp
        # Device and dtype.
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # The KV pool's storage dtype (--kv-cache-dtype): the model's, or FP8 on any device.
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        if self.device.type == "cuda":
            # Expandable segments keep reserved memory close to allocated memory (no
            # segments stranded at one block size), so what the plan measured is what
            # the step reserves later, and a shrunk pool really returns to the device.
            set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            (set_settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
        # Model config: enough to plan before any weight is read.
        self.model_dir: Path = resolve_model(config.model)
        self._grammar_compiler = None
        self._compiling = []  # requests waiting for their grammar (GrammarWaits)
        mc: ModelConfig = load_model_config(self.model_dir)
        # Settings the model cannot honour are refused here too (a GGUF the service could
        # not read before conversion): a number typed is honoured or refused, never cut.
        check_for_model(config, mc)
        # Token ids are checked and sampled over the whole vocabulary; every size below
        # (plan, pool, attention) is this rank's shard's.
        self.vocab_size = mc.vocab_size
        if tp is not None:
            mc = shard_rank_config(mc, tp)
        self.model_config = mc
        # A GGUF asked to keep its projections in block format (--gguf-quantized; on the
        # CPU its 4-bit blocks repacked into torch's int4 layout), else FP8 projections
        # (--quantization fp8, or an FP8 checkpoint): planned and loaded so, priced at
        # their bytes; otherwise dense in the model dtype.
        self.quantized_gguf, self.quantization, self.weight_size = weight_format(
            config, self.device, self.dtype, mc, self.model_dir)
        # The attention backend's name (auto resolved) and whether decode steps run as
        # CUDA graphs; both decide workspaces the plan charges.
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device.type,
                                                     windows=bool(mc.kv_windows),
                                                     softcap=bool(mc.attn_logit_softcapping), sinks=mc.attention_sinks,
                                                     kv_cache_dtype=config.kv_cache_dtype)
        self.cuda_graph_bytes = 0
        # Memory plan from estimates: a plan that cannot fit fails here, weights unread.
        # An oversized prefill chunk is the one knob lowered automatically (a chunk too
        # large for the card):
        # the plan picks the largest chunk whose activation peak fits.
        self.knobs = PlanKnobs.of(config, self.device.type)
        # What this process's caching allocator already held (an earlier engine in the
        # same process, a test): on the device, but not the plan's to size.
        self._reserved_at_start = (torch.cuda.memory_reserved(self.device)
                                   if self.device.type == "cuda" and torch.cuda.is_initialized() else 0)
        self.device_memory = device_memory(config, self.device) if self._planned else None
        self.plan: MemoryPlan | None = None
        if self.device_memory is not None:
            self.plan = self._fit_chunk(estimated_planner(config, mc, self.device, self.dtype, self.device_memory,
                                                          weights=self.weight_size))
        # Weights: on the device, or split with host memory (the routed experts of
        # --cpu-experts, the last decoder layers of --cpu-layers): engine.core.weights_stage.
        self._load_weights(mc, tp)
        # Profile run on a GPU: the measured step peak and the CUDA context replace the
        # estimates, and the plan is made again.
        if self.device_memory is not None and self.device.type == "cuda":
            self.plan = self._fit_measured()
            resize_cache(self.expert_stores, self.plan.expert_cache_slots)
            # Which lines take the card, as `headroom plan` prints them (measured now).
            log.info("the memory plan on %s:\n%s", self.plan.device, self.plan.table())
        if self.plan is not None and self.plan.context_lowered:
            log.warning("%s; it grows back with the KV pool when memory frees up", self.plan.context_note)
        # KV pool.
        num_pages = self._num_pages(mc)
        ring_pages = None
        if tp is not None:
            # Every rank holds the same page ids: the group's pools (the KV pool and the
            # sliding-window rings') are the tightest rank's.
            num_pages = tp.min_int(num_pages)
            ring_pages = tp.min_int(self._ring_pool_pages(num_pages))
        self.pool = self._kv_pool(num_pages, ring_pages)
        # Attention backend, and on a GPU one warm-up step at the plan's largest size, so
        # the step-size buffers sit in the allocator's cache before any request arrives,
        # and a fresh prompt's shapes, so their kernels compile before it does.
        self.attn = self._attention(self.pool)
        if self.plan is not None and self.device.type == "cuda":
            measure_step_peak(
                self.model, self.attn, self.pool, self.knobs, mc.max_position_embeddings,
                vocab_size=self.vocab_size,
            )
            warm_up_fresh_prompts(self.model, self.attn, self.pool)
        # Pages and prefix cache.
        self.allocator = PageAllocator(num_pages)
        # Live replans grow the pool back to the plan's size, or, when the plan lowered
        # the context, to one request of the wanted context.
        self.kv_pool_ceiling_pages = num_pages
        if self.plan is not None and self.plan.context_lowered:
            self.kv_pool_ceiling_pages = max(num_pages, self.min_kv_pool_pages(self.plan.wanted_context_tokens))
        # Hybrid linear-attention models: a state pool of one slot per running request and
        # the prefix cache's checkpoints of states at page boundaries
        # (engine.kvcache.state_pool, engine.scheduler.prefix_states).
        self.states = None
        if mc.is_hybrid:
            self.states = StatePool(mc, self.knobs.max_running_requests, self.dtype, self.device,
                                    checkpoints=self.knobs.state_checkpoints)
            self.model.bind_states(self.states)
        # Sliding-window layers that keep only their window: one ring of pages per running
        # request and the prefix cache's checkpoints of it (engine.kvcache.ring).
        ring = self._kv_ring
        self.ring = None if ring is None else RingPages(ring, self.pool.ring_pages, self.pool,
                                                        self.knobs.state_checkpoints)
        # What a live replan resizes the ring pool to beside the KV pool (engine.memory.kv_fit).
        self.ring_rule = self._ring_rule(self.pool)
        if ring is None and config.sliding_kv_ring != "off" and any(mc.kv_windows) and (
                why := kv_ring_excluded(mc, self.knobs)):
            log.info("sliding-window layers keep every token in the KV cache: no ring with %s", why)
        release = self.states.free_checkpoint if self.states is not None else (
            self.ring.free_checkpoint if self.ring is not None else None)
        self.radix = RadixCache(self.allocator, config.page_size, release_state=release) if config.prefix_cache else None
        # Scheduler and runner.
        model_ctx = mc.max_position_embeddings
        if config.max_model_len is not None:
            model_ctx = min(model_ctx, config.max_model_len)
        max_context_tokens = min(model_ctx, self.allocator.num_usable * config.page_size)
        # The scheduler's limits are the plan's knobs of the same names (the chunk cap
        # as the plan fitted it).
        self.scheduler = Scheduler(
            pick(self.knobs, SchedulerConfig, max_context_tokens=max_context_tokens, eos_token_ids=mc.eos_token_ids),
            self.allocator,
            self.radix,
            self.states,
            self.ring,
        )
        self.runner = ModelRunner(self.model, self.pool, self.attn, self.device, self.expert_stores)
        if self._use_cuda_graphs:
            self.cuda_graph_bytes = self.runner.enable_cuda_graphs(
                max_batch=self._cuda_graph_max_batch, max_context_tokens=model_ctx)
            # Up to the chunk the plan fitted (it may have halved --max-prefill-tokens).
            prefill_graph_tokens = min(self._prefill_graph_tokens, self.knobs.max_prefill_tokens)
            if prefill_graph_tokens:
                self.cuda_graph_bytes += self.runner.enable_prefill_graphs(
                    max_tokens=prefill_graph_tokens, max_context_tokens=model_ctx)
        if tp is not None and tp.is_leader:
            lead(self, tp)
        self._arrivals = itertools.count()
        self.info = EngineInfo(
            model_name=model_display_name(self.model_dir),
            model_dir=str(self.model_dir),
            architecture=mc.architecture,
            vocab_size=self.vocab_size,
            max_context_tokens=max_context_tokens,
            model_context_tokens=model_ctx,
            eos_token_ids=list(mc.eos_token_ids),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=config.page_size,
            num_pages=usable_pages(num_pages),
            kv_cache_bytes=self.pool.usable_bytes,
            kv_buffer_bytes=self.pool.nbytes,
            weight_bytes=model_weight_bytes(self.model),
            parameter_count=parameter_count(mc),
            weight_format=quantized_format(self.model),
            max_prefill_tokens=self.knobs.max_prefill_tokens,
            max_running_requests=self.knobs.max_running_requests,
            plan=self.plan,
            kv_cache_dtype=kv_dtype_name(self.kv_dtype),
            kv_bytes_per_token=kv_bytes_per_token(mc, self.kv_dtype, ring),
        )


    # -- public API -----------------------------------------------------------------------

    @property
    def max_context_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold now: the smaller of the
        model's context and what the KV pool holds for one request (it moves with a live
        resize)."""
        return self.scheduler.max_context_tokens

    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request.

        Raises:
            RequestRejected: empty prompt, a prompt that leaves no room for one new token
                in ``max_context_tokens`` (code ``context_length_exceeded``), a duplicate id,
                token ids outside the vocabulary, ``max_new_tokens < 1``, or a sampling
                parameter out of range (code ``invalid_request``).
        """
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", code="invalid_request", param="prompt")
        if n >= self.max_context_tokens:
            raise RequestRejected(
                f"the prompt has {n} tokens; this engine holds at most {self.max_context_tokens} "
                f"tokens per request (prompt + output), so it cannot run",
                code="context_length_exceeded",
                param="messages",
            )
        if req.sampling.max_new_tokens < 1:
            raise RequestRejected("max_new_tokens must be >= 1", code="invalid_request", param="max_tokens")
        if req.request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {req.request_id!r} is already running", code="invalid_request")
        vocab = self.vocab_size
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})", code="invalid_request", param="prompt")
        try:
            state = SamplingState(req.sampling, req.prompt_token_ids, vocab, self.device)
        except ValueError as exc:  # a sampling parameter out of range; the message names it
            raise RequestRejected(str(exc), code="invalid_request") from None
        request = Request(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_token_ids),
            sampling=req.sampling,
            state=state,
            arrival=next(self._arrivals),
            group=req.group,
            prompt_logprobs=None if req.sampling.prompt_logprobs is None else [None] * n,
        )
        if req.sampling.json_schema is not None:
            grammars = self._grammars()
            future = grammars.compile(req.sampling.json_schema)
            if not future.done():
                # Compiling in the background: the request waits for it, the steps go on.
                self._compiling.append((request, future, time.monotonic() + grammars.timeout_s))
                return
            try:
                state.matcher = grammars.matcher_of(future.result())
            except GrammarError as exc:
                raise RequestRejected(str(exc), code="invalid_request", param="response_format") from None
        self.scheduler.add(request)


    def abort(self, request_id: str) -> None:
        """End a request in any phase and free its pages; unknown ids are ignored. Its
        final ``TokenOutput`` (``finish_reason="abort"``) comes with the next step."""
        self.scheduler.abort(request_id)
        self._compiling = [c for c in self._compiling if c[0].request_id != request_id]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling)

    def step(self) -> list[TokenOutput]:
        """Run one step (schedule -> forward -> commit) and report what changed.

        A step that runs out of device memory (``torch.OutOfMemoryError`` in the forward
        or in sampling) is rolled back and does not raise: see :mod:`engine.core.oom`. A
        request that cannot run even alone ends here with ``finish_reason="error"``,
        ``error_code="out_of_memory"``; the others run again in later steps.
        :meth:`drain_events` reports what was done.

        Raises:
            Whatever else the model or the sampler raises (the worker then ends).
        """
        refused = self._admit_compiled()
        plan = self.scheduler.schedule()
        touched: list[Request] = []
        if plan is not None:
            oom_text = None
            try:
                sampled = self.runner.run(plan)
            except torch.OutOfMemoryError as exc:
                # Only the text leaves this block: the traceback holds the failed step's
                # tensors, and they must be gone before the allocator's cache is emptied.
                oom_text = str(exc)
            else:
                self.scheduler.commit(plan, sampled)
                # A request whose logits could not be sampled from fails alone (the model
                # produced NaN or +inf for it); the others' tokens stand.
                for rid, message in self.runner.unusable.items():
                    self.scheduler.fail(self.scheduler.requests[rid], ERROR_INVALID_LOGITS, message)
                touched = [it.req for it in plan.items if it.req.request_id in sampled]
                keep_logprobs(self.runner, plan)
                if self._oom is not None:
                    self._oom.after_good_step(plan)
            if oom_text is not None:
                self._oom_recovery().recover(plan, self.runner.stage, oom_text)
        ended = self.scheduler.drain_ended()
        outputs = [token_output(r) for r in touched if r not in ended]
        outputs.extend(token_output(r) for r in ended)
        return refused + outputs


    def drain_events(self) -> list:
        """Engine events since the last call (``list[engine.wire.messages.EngineEvent]``): an
        ``OomEvent`` per out-of-memory step, in order, then at most one ``ReplanWanted``
        carrying the current prefill chunk cap, then a ``Replanned`` per live change of
        memory use (:meth:`resize_kv_pool`, :meth:`set_prefill_chunk`,
        :meth:`evict_prefix_cache`), in order. Empty while nothing of that happened."""
        out = self._oom.drain_events() if self._oom is not None else []
        if self._replans:
            out.extend(self._replans)
            self._replans.clear()
        return out

    @property
    def faults(self):
        """The test-only fault injector (``engine.common.faults.FaultInjector``), the one
        ``HEADROOM_FAULTS`` configured or a new, empty one: ``engine.faults.add(site,
        request_id, times)``."""
        if self.runner.faults is None:
            from engine.common.faults import FaultInjector

            self.runner.faults = FaultInjector()
        return self.runner.faults

    # Made on the first out-of-memory step (``engine.core.oom.OomRecovery``): an engine that
    # never runs out of memory carries none of its state, and a step pays one ``is None``.
    _oom = None

    def _oom_recovery(self):
        if self._oom is None:
            from engine.core.oom import OomRecovery

            self._oom = OomRecovery(self.scheduler, self.config.page_size, self.device)
        return self._oom

    def stats(self) -> EngineStats:
        radix = self.radix
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_pages=self.allocator.num_free,
            total_pages=self.allocator.num_usable,
            cached_pages=radix.num_cached_pages if radix else 0,
            prefix_hit_tokens=radix.hit_tokens if radix else 0,
            prefix_lookup_tokens=radix.lookup_tokens if radix else 0,
            finished=self.scheduler.finished_count,
            aborted=self.scheduler.aborted_count,
            failed=self.scheduler.failed_count,
            **self._expert_stats(),
        )

    def _expert_stats(self) -> dict[str, int]:
        """The expert cache's counters for :class:`EngineStats` (none without one)."""
        c = self.expert_counters
        if c is None:
            return {}
        for store in self.expert_stores:
            store.count_bus_reads()
        return dict(expert_cache_hits=c.hits, expert_cache_misses=c.misses, expert_copies=c.copies,
                    expert_cpu_runs=c.cpu_runs, expert_bus_reads=c.bus_reads,
                    expert_cache_slots=sum(s.num_slots for s in self.expert_stores))

