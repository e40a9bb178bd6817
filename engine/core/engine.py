"""The engine facade: load a model, plan its memory, size the KV pool, run steps.

Used in-process by ``headroom generate`` and by the worker process of ``headroom serve``.
The constructor reads top to bottom: device and dtype, model config, memory plan
(before any weight loads), weights, profile run, KV pool, attention backend, prefix
cache, scheduler. A step is schedule -> forward -> commit.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from concurrent import futures
from pathlib import Path

import torch

from engine.layers.attention.base import backend_class, create_attention_backend, resolve_backend_name
from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import PlanDoesNotFit, RequestRejected
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.pool import KVPool, kv_storage_dtype
from engine.kvcache.radix import RadixCache
from engine.kvcache.state_pool import StatePool
from engine.core.live_replan import LiveReplan
from engine.loader.default_model import model_display_name
from engine.loader.fp8 import resolve_quantization
from engine.loader.gguf_quant import gguf_weight_size
from engine.loader.hf_config import load_model_config
from engine.loader.load import fp8_weight_size, load_model, parameter_count
from engine.loader.resolve import resolve_model
from engine.memory.fixed_pool import unplanned_pages
from engine.core.footprint import kv_bytes_per_token, make_footprint
from engine.memory.host import trim_host_heap
from engine.memory.plan import MemoryPlan, PlanKnobs, fit_plan, make_plan
from engine.core.profile import measure_step_peak, profile_pool_pages
from engine.wire.messages import (
    ERROR_INVALID_SCHEMA,
    FINISH_ERROR,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    TokenOutput,
)
from engine.layers.linear.cpu_kernels import cpu_kernels
from engine.layers.linear.cpu_int4 import pack_model_for_cpu
from engine.layers.moe.expert_cache import (
    ExpertCounters,
    OffloadedExperts,
    offload_experts,
    resize_cache,
)
from engine.layers.linear.gguf_blocks import (
    model_weight_bytes,
    quantized_format,
    repack_model_for_kernels,
)
from engine.common.options import pick
from engine.core.tp_follow import lead
from engine.parallel.group import TensorParallel
from engine.parallel.shard import rank_config as shard_rank_config
from engine.core.runner import ModelRunner
from engine.sampling.grammar import GrammarCompiler, GrammarError
from engine.sampling.sampler import SamplingState
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.core.settings_fit import check_for_model
from engine.core.startup import (
    attention_workspaces,
    device_memory,
    estimated_planner,
    quantized_gguf,
    resolve_device,
    resolve_dtype,
    use_kernel_switches,
)

log = logging.getLogger("headroom.engine")


class Engine(LiveReplan):
    """One model on one device, serving many requests by continuous batching.

    Single-threaded: call every method from one thread. The live replans (resize the KV
    pool, set the prefill chunk cap, evict the prefix cache) are
    :class:`engine.core.live_replan.LiveReplan`'s.

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
        self._grammar_compiler: GrammarCompiler | None = None
        # Requests waiting for their grammar's compile: (request, future, deadline).
        self._compiling: list[tuple[Request, futures.Future, float]] = []
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
        # CPU its 4-bit blocks repacked into torch's int4 layout): planned and loaded so;
        # otherwise dequantized at load and priced dense.
        self.quantized_gguf = quantized_gguf(config, self.device, mc)
        self.weight_size = None if self.quantized_gguf is None else gguf_weight_size(
            self.quantized_gguf, mc, self.dtype, self.device.type)
        # FP8 projections (--quantization fp8, or an FP8 checkpoint), priced at their bytes.
        self.quantization = None if self.quantized_gguf is not None else resolve_quantization(
            config.quantization, self.model_dir)
        if self.quantization == "fp8":
            self.weight_size = fp8_weight_size(mc, self.dtype)
        # The attention backend's name (auto resolved) and whether decode steps run as
        # CUDA graphs; both decide workspaces the plan charges.
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device.type)
        self.cuda_graph_bytes = 0
        # Memory plan from estimates: a plan that cannot fit fails here, weights unread.
        # An oversized prefill chunk is the one knob lowered automatically (a chunk too
        # large for the card):
        # the plan picks the largest chunk whose activation peak fits.
        self.knobs = PlanKnobs.of(config)
        # What this process's caching allocator already held (an earlier engine in the
        # same process, a test): on the device, but not the plan's to size.
        self._reserved_at_start = (torch.cuda.memory_reserved(self.device)
                                   if self.device.type == "cuda" and torch.cuda.is_initialized() else 0)
        self.device_memory = device_memory(config, self.device) if self._planned else None
        self.plan: MemoryPlan | None = None
        if self.device_memory is not None:
            self.plan = self._fit_chunk(estimated_planner(config, mc, self.device, self.dtype, self.device_memory,
                                                          weights=self.weight_size))
        # Weights. With a hybrid plan (--cpu-experts) the model is read into host memory,
        # the chosen layers' routed experts stay there behind a device expert cache, and
        # the rest moves to the device. A GGUF read in blocks is read in the device's
        # layout (experts in blocks on CUDA), so the host tier holds the blocks.
        self.expert_stores: list[OffloadedExperts] = []
        self.expert_counters: ExpertCounters | None = None
        host_layers = self.plan.cpu_expert_layers if self.plan is not None else 0
        if self.plan is None and mc.is_moe and config.cpu_experts not in ("auto", "none"):
            # No device to plan for (the CPU without a simulated --device-total): nothing to split.
            log.warning("--cpu-experts %s has no effect on %s without a planned device (--device-total): every "
                        "weight is in host memory already", config.cpu_experts, self.device)
        if host_layers:
            # The measured plan keeps the split the weights were loaded with.
            self.knobs = dataclasses.replace(self.knobs, cpu_experts=str(host_layers))
            self.model, _ = load_model(self.model_dir, "cpu", self.dtype, load_format=config.load_format,
                                       quantized_gguf=self.quantized_gguf, quantization=self.quantization,
                                       embeddings_in_blocks=self.device.type == "cpu",
                                       experts_in_blocks=self.device.type != "cpu")
            layers = mc.moe_layers[-host_layers:]
            self.expert_stores, self.expert_counters = offload_experts(
                self.model, layers, 0, device=self.device)
            self.model.to(self.device)
            if self.device.type == "cuda":
                repack_model_for_kernels(self.model)  # read on the host: repacked once on the device
            resize_cache(self.expert_stores, self.plan.expert_cache_slots)
            log.info("routed experts of %d of %d MoE layers in host memory; expert cache of %d slots",
                     host_layers, len(mc.moe_layers), self.plan.expert_cache_slots)
        else:
            self.model, _ = load_model(self.model_dir, self.device, self.dtype, load_format=config.load_format,
                                       quantized_gguf=self.quantized_gguf, quantization=self.quantization, tp=tp,
                                       embeddings_in_blocks=self.device.type == "cpu")
        if self.quantized_gguf is not None and self.device.type == "cpu":
            pack_model_for_cpu(self.model, self.dtype, cpu_kernels())  # the block kernels are GPU kernels
            trim_host_heap()  # the freed blocks and file tables would stay resident
        # Profile run on a GPU: the measured step peak and the CUDA context replace the
        # estimates, and the plan is made again.
        if self.device_memory is not None and self.device.type == "cuda":
            self.plan = self._fit_chunk(self._measured_plan)
            resize_cache(self.expert_stores, self.plan.expert_cache_slots)
        if self.plan is not None and self.plan.context_lowered:
            log.warning("%s; it grows back with the KV pool when memory frees up", self.plan.context_note)
        # KV pool.
        num_pages = self._num_pages(mc)
        if tp is not None:
            # Every rank holds the same page ids: the group's pool is the tightest rank's.
            num_pages = tp.min_int(num_pages)
        self.pool = KVPool(
            num_layers=mc.num_kv_layers,
            num_pages=num_pages,
            page_size=config.page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            compute_dtype=self.dtype,
        )
        # Attention backend, and on a GPU one warm-up step at the plan's largest size, so
        # the step-size buffers sit in the allocator's cache before any request arrives.
        self.attn = self._attention(self.pool)
        if self.plan is not None and self.device.type == "cuda":
            measure_step_peak(
                self.model, self.attn, self.pool, self.knobs, mc.max_position_embeddings,
                vocab_size=self.vocab_size,
            )
        # Pages and prefix cache.
        self.allocator = PageAllocator(num_pages)
        # Live replans grow the pool back to the plan's size, or, when the plan lowered
        # the context, to one request of the wanted context.
        self.kv_pool_ceiling_pages = num_pages
        if self.plan is not None and self.plan.context_lowered:
            self.kv_pool_ceiling_pages = max(num_pages, self.min_kv_pool_pages(self.plan.wanted_context_tokens))
        # Hybrid linear-attention models: no prefix reuse (a shared prefix's KV pages are
        # kept, but not the linear layers' states after it), and a state pool of one slot
        # per running request (engine.kvcache.state_pool).
        self.radix = (RadixCache(self.allocator, config.page_size)
                      if config.prefix_cache and not mc.is_hybrid else None)
        self.states = None
        if mc.is_hybrid:
            self.states = StatePool(mc, self.knobs.max_running_requests, self.dtype, self.device)
            self.model.bind_states(self.states)
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
        )
        self.runner = ModelRunner(self.model, self.pool, self.attn, self.device)
        if self._use_cuda_graphs:
            self.cuda_graph_bytes = self.runner.enable_cuda_graphs(
                max_batch=self._cuda_graph_max_batch, max_context_tokens=model_ctx)
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
            num_pages=num_pages,
            kv_cache_bytes=self.pool.nbytes,
            weight_bytes=model_weight_bytes(self.model),
            parameter_count=parameter_count(mc),
            weight_format=quantized_format(self.model),
            max_prefill_tokens=self.knobs.max_prefill_tokens,
            max_running_requests=config.max_running_requests,
            plan=self.plan,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_bytes_per_token=kv_bytes_per_token(mc, self.kv_dtype),
        )

    # -- construction stages --------------------------------------------------------------

    @property
    def _planned(self) -> bool:
        c = self.config
        return c.num_pages is None and c.kv_cache is None and (
            c.device_total is not None or self.device.type == "cuda"
        )

    def _workspaces(self) -> tuple[tuple[str, int], ...]:
        """Fixed workspaces declared by the components, charged before the pool is sized."""
        return attention_workspaces(self.attention_backend, self.model_config, self.config.max_running_requests)

    def _attention(self, pool: KVPool):
        mc = self.model_config
        return create_attention_backend(self.attention_backend, pool, num_heads=mc.num_heads, head_dim=mc.head_dim,
                                        scale=mc.head_dim**-0.5, max_batch=self.config.max_running_requests)

    _graph_bytes_measured: int | None = None

    @property
    def _use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: asked for (the default), on CUDA, and the
        backend's decode path can be captured (the torch backend's cannot: it builds its
        metadata on the host per step)."""
        # Not for hybrid linear-attention models yet (their state slots are read on the
        # host), nor where a layer's experts live in host memory (the routed ids are read
        # back each step). Under tensor parallelism every rank can capture its graphs, the
        # all-reduces inside (engine.core.tp_graphs), but that path has not yet run on
        # two GPUs: it stays opt-in (--tp-cuda-graphs) until it has, and the group
        # decodes eagerly as measured.
        tp_ok = self.tp is None or self.config.tp_cuda_graphs
        return (self.config.cuda_graphs and self.device.type == "cuda" and self._cuda_graph_max_batch >= 1
                and not self.model_config.is_hybrid and not self.expert_stores and tp_ok
                and backend_class(self.attention_backend).supports_cuda_graphs)

    @property
    def _cuda_graph_max_batch(self) -> int:
        return min(self.config.cuda_graph_max_batch, self.config.max_running_requests)

    def _measure_cuda_graphs(self, model_ctx: int, probe_pool: KVPool) -> int:
        """Capture the decode graphs over the profile run's small pool and return what
        they took, then drop them: the plan charges it before the real pool is sized
        (the real capture, over the real pool, takes the same: same shapes, same
        kernels)."""
        from engine.core.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self._attention(probe_pool), self.device, page_size=self.config.page_size,
                              max_batch=self._cuda_graph_max_batch, max_context_tokens=model_ctx)
        try:
            return graphs.capture_all()
        finally:
            del graphs
            torch.cuda.empty_cache()

    def _fit_chunk(self, planner) -> MemoryPlan:
        """Plan with ``self.knobs`` as :func:`engine.memory.plan.fit_plan` does: the
        context lowered to what the pool holds, down to ``--min-context``, and the
        prefill chunk halved only when even that floor does not fit; sets ``self.knobs``
        to what fits.

        Raises:
            PlanDoesNotFit: with the plan at the configured chunk, whose message names
                what to change.
        """
        plan, knobs = fit_plan(planner, self.knobs)
        if not plan.fits:
            raise PlanDoesNotFit(plan)
        self.knobs = knobs
        return plan

    def _measured_plan(self, knobs: PlanKnobs) -> MemoryPlan:
        """Run one worst-case step at ``knobs`` on a small pool and plan with what it
        measured."""
        assert self.device_memory is not None
        mc = self.model_config
        torch.cuda.empty_cache()
        probe_pool = KVPool(
            num_layers=mc.num_kv_layers, num_pages=profile_pool_pages(knobs), page_size=self.config.page_size,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=self.kv_dtype, device=self.device,
            compute_dtype=self.dtype,
        )
        # Where the context grows (logged): after the weights, the profile step, the capture.
        growth = [self._outside_allocator_growth()]
        try:
            peak = measure_step_peak(
                self.model, self._attention(probe_pool), probe_pool, knobs, mc.max_position_embeddings,
                vocab_size=self.vocab_size,
            )
        except torch.OutOfMemoryError:
            # The step does not fit at all: charge everything that was free.
            peak = None
        growth.append(self._outside_allocator_growth())
        graph_bytes = 0
        if peak is not None and self._use_cuda_graphs:
            # The graphs' memory does not depend on the prefill chunk: measured once,
            # however many chunks the plan tries.
            if self._graph_bytes_measured is None:
                model_ctx = min(mc.max_position_embeddings, self.config.max_model_len or mc.max_position_embeddings)
                self._graph_bytes_measured = self._measure_cuda_graphs(model_ctx, probe_pool)
            graph_bytes = self._graph_bytes_measured
        del probe_pool
        # Nothing of the profile stays cached: the pool is sized against a clean device.
        torch.cuda.empty_cache()
        growth.append(self._outside_allocator_growth())
        log.info("CUDA context growth outside the allocator since the plan's probe: %.0f MiB after the weights, "
                 "%.0f MiB after the profile step, %.0f MiB after the decode graphs' capture (if any)",
                 *(g / 2**20 for g in growth))
        runtime = self._runtime_bytes()
        if peak is None:
            activation, sampler = self.device_memory.total_bytes, None
        else:
            activation, sampler = peak.forward_bytes, peak.sampler_bytes
        fp = make_footprint(
            mc, self.dtype, knobs, workspaces=self._workspaces(), measured_activation_bytes=activation,
            measured_sampler_bytes=sampler, runtime_bytes=runtime, cuda_graph_bytes=graph_bytes,
            weights=self.weight_size,
        )
        return make_plan(self.device_memory, knobs, fp)

    def _runtime_bytes(self) -> int:
        """The plan's "CUDA context and runtime" line: this process's device memory
        outside the caching allocator (CUDA context, kernel modules, library handles).

        Two parts: what NVML already attributed to this process at start (its context,
        when NVML lists processes; inside a container it lists none and the plan counted
        that memory as other processes'), and what the process took since, less the
        growth of the allocator's reservations (charged on their own lines). The growth
        is measured from the allocator's reservation at start, not from zero, so memory
        the allocator held before the engine (an earlier engine in the same process)
        does not hide the context's growth.
        """
        dm = self.device_memory
        assert dm is not None
        own_at_start = 0 if dm.simulated else max(dm.total_bytes - dm.free_bytes - dm.others_bytes, 0)
        return own_at_start + max(self._outside_allocator_growth(), 0)

    def _outside_allocator_growth(self) -> int:
        """Bytes the device lost since the plan's probe that the caching allocator does not
        hold (context growth: kernel modules, library handles, graph executables)."""
        assert self.device_memory is not None
        free_now, _ = torch.cuda.mem_get_info(self.device)
        grown = self.device_memory.free_bytes - free_now
        return grown - (torch.cuda.memory_reserved(self.device) - self._reserved_at_start)

    def _num_pages(self, mc: ModelConfig) -> int:
        """Pool size in pages, the null page included (see EngineConfig for the order)."""
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if self.plan is not None:
            return self.plan.num_pages + 1
        return unplanned_pages(cfg, mc, kv_bytes_per_token(mc, self.kv_dtype) * cfg.page_size)

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

    def _admit_compiled(self) -> list[TokenOutput]:
        """Requests whose grammar has compiled go to the scheduler; those whose compile
        failed or ran past its time end with ``error_code`` :data:`ERROR_INVALID_SCHEMA`."""
        if not self._compiling:
            return []
        if not self.scheduler.has_work():
            # Nothing else to run: wait a little for a compile rather than spin.
            futures.wait([f for _, f, _ in self._compiling], timeout=0.01, return_when=futures.FIRST_COMPLETED)
        failed, waiting = [], []
        now = time.monotonic()
        for request, future, deadline in self._compiling:
            if future.done():
                try:
                    request.state.matcher = self._grammars().matcher_of(future.result())
                except GrammarError as exc:
                    failed.append(self._failed(request, str(exc)))
                    continue
                self.scheduler.add(request)
            elif now > deadline:
                failed.append(self._failed(request, self._grammars().timeout_message()))
            else:
                waiting.append((request, future, deadline))
        self._compiling = waiting
        return failed

    @staticmethod
    def _failed(request: Request, message: str) -> TokenOutput:
        return TokenOutput(request_id=request.request_id, token_ids=[], finished=True, finish_reason=FINISH_ERROR,
                           error_code=ERROR_INVALID_SCHEMA, error_message=message,
                           prompt_tokens=len(request.prompt_ids))

    def _grammars(self) -> GrammarCompiler:
        """The JSON-schema compiler, made on the first structured-output request."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.model_dir, self.vocab_size, list(self.model_config.eos_token_ids)
            )
        return self._grammar_compiler

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
                touched = [it.req for it in plan.items if it.req.request_id in sampled]
                self._keep_logprobs(plan)
                if self._oom is not None:
                    self._oom.after_good_step(plan)
            if oom_text is not None:
                self._oom_recovery().recover(plan, self.runner.stage, oom_text)
        ended = self.scheduler.drain_ended()
        outputs = [self._output(r) for r in touched if r not in ended]
        outputs.extend(self._output(r) for r in ended)
        return refused + outputs

    def _keep_logprobs(self, plan) -> None:
        """File the runner's logprobs of a committed step with their requests."""
        runner = self.runner
        if not runner.logprobs and not runner.prompt_logprobs:
            return
        for it in plan.items:
            req = it.req
            record = runner.logprobs.get(req.request_id)
            if record is not None:
                req.output_logprobs.append(record)
            scored = runner.prompt_logprobs.get(req.request_id)
            if scored and req.prompt_logprobs is not None:
                for position, rec in scored:
                    req.prompt_logprobs[position] = rec

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
        return dict(expert_cache_hits=c.hits, expert_cache_misses=c.misses, expert_copies=c.copies,
                    expert_cpu_runs=c.cpu_runs, expert_cache_slots=sum(s.num_slots for s in self.expert_stores))

    def _output(self, req: Request) -> TokenOutput:
        start = req.emitted
        new = req.output_ids[start:]
        req.emitted = len(req.output_ids)
        done = req.phase is Phase.FINISHED
        logprobs = prompt_logprobs = None
        if req.sampling.logprobs is not None:
            logprobs = req.output_logprobs[start : start + len(new)]
        if req.prompt_logprobs is not None and (new or done):
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        return TokenOutput(
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            request_id=req.request_id,
            token_ids=new,
            finished=done,
            finish_reason=req.finish_reason if done else None,
            error_code=req.error_code,
            error_message=req.error_message,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.prompt_cached_tokens,
        )
