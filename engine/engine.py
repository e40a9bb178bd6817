"""The engine facade: load a model, plan its memory, size the KV pool, run steps.

Used in-process by ``headroom generate`` and by the worker process of ``headroom serve``.
The constructor reads top to bottom: device and dtype, model config, memory plan
(before any weight loads), weights, profile run, KV pool, attention backend, prefix
cache, scheduler. A step is schedule -> forward -> commit.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import torch

from engine.attention.base import backend_class, create_attention_backend, resolve_backend_name
from engine.config import EngineConfig, ModelConfig
from engine.errors import PlanDoesNotFit, RequestRejected
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.pool import KVPool
from engine.kvcache.radix import RadixCache
from engine.loader.default_model import model_display_name
from engine.loader.hf_config import load_model_config
from engine.loader.load import load_model
from engine.loader.resolve import resolve_model
from engine.memory.device import probe_nvml, simulated_device
from engine.memory.footprint import CUDA_RUNTIME_ESTIMATE_BYTES, kv_bytes_per_token, make_footprint
from engine.memory.plan import MIN_PREFILL_TOKENS, DeviceMemory, MemoryPlan, PlanKnobs, make_plan
from engine.memory.profile import measure_step_peak, profile_pool_pages
from engine.messages import (
    FINISH_LENGTH,
    REPLAN_EVICT_PREFIX_CACHE,
    REPLAN_PREFILL_CHUNK,
    REPLAN_RESIZE_POOL,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    Replanned,
    ResizeResult,
    TokenOutput,
)
from engine.runner import ModelRunner
from engine.sampling.sampler import SamplingState
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("headroom.engine")

# Without a memory plan (CPU, or a fixed size asked for), the pool gets this much.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on CPU (CPU bf16 matmuls are slow).

    Raises:
        ValueError: an unknown dtype name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def plan_knobs(config: EngineConfig) -> PlanKnobs:
    """The plan's knobs from an engine config."""
    return PlanKnobs(
        page_size=config.page_size,
        max_prefill_tokens=config.max_prefill_tokens,
        max_running_requests=config.max_running_requests,
        max_model_len=config.max_model_len,
        min_context_tokens=config.min_context_tokens,
        reserve_bytes=config.reserve_bytes,
        safety_margin_bytes=config.safety_margin_bytes,
        device_limit_bytes=config.device_limit_bytes,
    )


def device_memory(config: EngineConfig, device: torch.device) -> DeviceMemory | None:
    """The device as the plan sees it now: simulated when asked, NVML (or the CUDA
    driver's free/total) on a GPU, None for a plain CPU run (no plan)."""
    if config.simulate_device_total_bytes is not None:
        return simulated_device(
            config.simulate_device_total_bytes,
            config.simulate_device_free_bytes,
            display_attached=config.simulate_display_attached,
        )
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    nvml_index = int(visible.split(",")[index]) if visible and visible.split(",")[index].strip().isdigit() else index
    snap = probe_nvml(nvml_index)
    if snap is not None:
        return snap
    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    return DeviceMemory(name=name, total_bytes=total, free_bytes=free, others_bytes=total - free)


def attention_workspaces(backend: str, mc: ModelConfig, max_running_requests: int) -> tuple[tuple[str, int], ...]:
    """The plan's workspace lines for attention backend ``backend`` (a resolved name)."""
    size = backend_class(backend).workspace_size(
        num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, max_batch=max_running_requests)
    return ((f"attention backend ({backend})", size),)


class Engine:
    """One model on one device, serving many requests by continuous batching.

    Single-threaded: call every method from one thread.

    Raises (constructor): the loader's ``ModelLoadError`` subclasses for a missing or
    broken model; :class:`PlanDoesNotFit` when the memory plan cannot hold one request
    of the minimum context (raised before the weights load where the sizes show it);
    ``ValueError`` for a bad config value.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Device and dtype.
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            # Expandable segments keep reserved memory close to allocated memory (no
            # segments stranded at one block size), so what the plan measured is what
            # the step reserves later, and a shrunk pool really returns to the device.
            set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            (set_settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
        # Model config: enough to plan before any weight is read.
        self.model_dir: Path = resolve_model(config.model)
        mc: ModelConfig = load_model_config(self.model_dir)
        self.model_config = mc
        # The attention backend's name (auto resolved) and whether decode steps run as
        # CUDA graphs; both decide workspaces the plan charges.
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device.type)
        self.cuda_graph_bytes = 0
        # Memory plan from estimates: a plan that cannot fit fails here, weights unread.
        # An oversized prefill chunk is the one knob lowered automatically (CASES F3):
        # the plan picks the largest chunk whose activation peak fits.
        self.knobs = plan_knobs(config)
        self.device_memory = device_memory(config, self.device) if self._planned else None
        self.plan: MemoryPlan | None = None
        if self.device_memory is not None:
            runtime = CUDA_RUNTIME_ESTIMATE_BYTES if self._on_gpu_or_simulated else 0
            self.plan = self._fit_chunk(lambda knobs: make_plan(self.device_memory, knobs, make_footprint(
                mc, self.dtype, knobs, workspaces=self._workspaces(), runtime_bytes=runtime)))
        # Weights.
        self.model, _ = load_model(self.model_dir, self.device, self.dtype, load_format=config.load_format)
        # Profile run on a GPU: the measured step peak and the CUDA context replace the
        # estimates, and the plan is made again.
        if self.device_memory is not None and self.device.type == "cuda":
            self.plan = self._fit_chunk(self._measured_plan)
        # KV pool.
        num_pages = self._num_pages(mc)
        self.pool = KVPool(
            num_layers=mc.num_layers,
            num_pages=num_pages,
            page_size=config.page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        # Attention backend, and on a GPU one warm-up step at the plan's largest size, so
        # the step-size buffers sit in the allocator's cache before any request arrives.
        self.attn = self._attention(self.pool)
        if self.plan is not None and self.device.type == "cuda":
            measure_step_peak(self.model, self.attn, self.pool, self.knobs, mc.max_position_embeddings)
        # Pages and prefix cache.
        self.allocator = PageAllocator(num_pages)
        self.radix = RadixCache(self.allocator, config.page_size) if config.enable_prefix_cache else None
        # Scheduler and runner.
        model_ctx = mc.max_position_embeddings
        if config.max_model_len is not None:
            model_ctx = min(model_ctx, config.max_model_len)
        self.max_context_tokens = min(model_ctx, self.allocator.num_usable * config.page_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=config.page_size,
                max_running_requests=config.max_running_requests,
                max_prefill_tokens=self.knobs.max_prefill_tokens,
                max_context_tokens=self.max_context_tokens,
                eos_token_ids=mc.eos_token_ids,
            ),
            self.allocator,
            self.radix,
        )
        self.runner = ModelRunner(self.model, self.pool, self.attn, self.device)
        if self._use_cuda_graphs:
            self.cuda_graph_bytes = self.runner.enable_cuda_graphs(
                max_batch=self._cuda_graph_max_batch, max_context_tokens=model_ctx)
        self._arrivals = itertools.count()
        self.info = EngineInfo(
            model_name=model_display_name(self.model_dir),
            model_dir=str(self.model_dir),
            architecture=mc.architecture,
            vocab_size=mc.vocab_size,
            max_context_tokens=self.max_context_tokens,
            model_context_tokens=model_ctx,
            eos_token_ids=list(mc.eos_token_ids),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=config.page_size,
            num_pages=num_pages,
            kv_cache_bytes=self.pool.nbytes,
            weight_bytes=sum(p.nbytes for p in self.model.parameters()),
            max_prefill_tokens=self.knobs.max_prefill_tokens,
            max_running_requests=config.max_running_requests,
            plan=self.plan,
        )

    # -- construction stages --------------------------------------------------------------

    @property
    def _planned(self) -> bool:
        c = self.config
        return c.num_pages is None and c.kv_cache_bytes is None and (
            c.simulate_device_total_bytes is not None or self.device.type == "cuda"
        )

    @property
    def _on_gpu_or_simulated(self) -> bool:
        return self.device.type == "cuda" or self.config.simulate_device_total_bytes is not None

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
        return (self.config.cuda_graphs and self.device.type == "cuda" and self._cuda_graph_max_batch >= 1
                and backend_class(self.attention_backend).supports_cuda_graphs)

    @property
    def _cuda_graph_max_batch(self) -> int:
        return min(self.config.cuda_graph_max_batch, self.config.max_running_requests)

    def _measure_cuda_graphs(self, model_ctx: int, probe_pool: KVPool) -> int:
        """Capture the decode graphs over the profile run's small pool and return what
        they took, then drop them: the plan charges it before the real pool is sized
        (the real capture, over the real pool, takes the same: same shapes, same
        kernels)."""
        from engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self._attention(probe_pool), self.device, page_size=self.config.page_size,
                              max_batch=self._cuda_graph_max_batch, max_context_tokens=model_ctx)
        try:
            return graphs.capture_all()
        finally:
            del graphs
            torch.cuda.empty_cache()

    def _fit_chunk(self, planner) -> MemoryPlan:
        """Plan with ``self.knobs``, halving the prefill chunk until the plan fits (floor
        ``MIN_PREFILL_TOKENS``); sets ``self.knobs`` to what fits.

        Raises:
            PlanDoesNotFit: with the plan at the configured chunk, whose message names
                what to change.
        """
        first = plan = planner(self.knobs)
        knobs = self.knobs
        while not plan.fits and knobs.max_prefill_tokens > MIN_PREFILL_TOKENS:
            knobs = replace(knobs, max_prefill_tokens=max(knobs.max_prefill_tokens // 2, MIN_PREFILL_TOKENS))
            plan = planner(knobs)
        if not plan.fits:
            raise PlanDoesNotFit(first)
        self.knobs = knobs
        return plan

    def _measured_plan(self, knobs: PlanKnobs) -> MemoryPlan:
        """Run one worst-case step at ``knobs`` on a small pool and plan with what it
        measured."""
        assert self.device_memory is not None
        mc = self.model_config
        torch.cuda.empty_cache()
        probe_pool = KVPool(
            num_layers=mc.num_layers, num_pages=profile_pool_pages(knobs), page_size=self.config.page_size,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=self.dtype, device=self.device,
        )
        try:
            peak = measure_step_peak(self.model, self._attention(probe_pool), probe_pool, knobs, mc.max_position_embeddings)
        except torch.OutOfMemoryError:
            # The step does not fit at all: charge everything that was free.
            peak = None
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
        # The CUDA context: what this process holds beyond the allocator's reservations.
        free_now, _ = torch.cuda.mem_get_info(self.device)
        used_by_us = self.device_memory.free_bytes - free_now
        runtime = max(used_by_us - torch.cuda.memory_reserved(self.device), 0)
        if peak is None:
            activation, sampler = self.device_memory.total_bytes, None
        else:
            activation, sampler = peak.forward_bytes, peak.sampler_bytes
        fp = make_footprint(
            mc, self.dtype, knobs, workspaces=self._workspaces(), measured_activation_bytes=activation,
            measured_sampler_bytes=sampler, runtime_bytes=runtime, cuda_graph_bytes=graph_bytes,
        )
        return make_plan(self.device_memory, knobs, fp)

    def _num_pages(self, mc: ModelConfig) -> int:
        """Pool size in pages, the null page included (see EngineConfig for the order)."""
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        if self.plan is not None:
            return self.plan.num_pages + 1
        page_bytes = kv_bytes_per_token(mc, self.dtype) * cfg.page_size
        budget = cfg.kv_cache_bytes if cfg.kv_cache_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES
        # Without a plan: never fewer pages than one full context needs (+ the null page).
        want_ctx = min(mc.max_position_embeddings, cfg.max_model_len or mc.max_position_embeddings)
        floor = math.ceil(want_ctx / cfg.page_size) + 1 if cfg.kv_cache_bytes is None else 2
        return max(budget // page_bytes, floor)

    # -- public API -----------------------------------------------------------------------

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
        vocab = self.model_config.vocab_size
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})", code="invalid_request", param="prompt")
        try:
            state = SamplingState(req.sampling, req.prompt_token_ids, vocab, self.device)
        except ValueError as exc:  # a sampling parameter out of range; the message names it
            raise RequestRejected(str(exc), code="invalid_request") from None
        self.scheduler.add(
            Request(
                request_id=req.request_id,
                prompt_ids=list(req.prompt_token_ids),
                sampling=req.sampling,
                state=state,
                arrival=next(self._arrivals),
            )
        )

    def abort(self, request_id: str) -> None:
        """End a request in any phase and free its pages; unknown ids are ignored. Its
        final ``TokenOutput`` (``finish_reason="abort"``) comes with the next step."""
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenOutput]:
        """Run one step (schedule -> forward -> commit) and report what changed.

        A step that runs out of device memory (``torch.OutOfMemoryError`` in the forward
        or in sampling) is rolled back and does not raise: see :mod:`engine.oom`. A
        request that cannot run even alone ends here with ``finish_reason="error"``,
        ``error_code="out_of_memory"``; the others run again in later steps.
        :meth:`drain_events` reports what was done.

        Raises:
            Whatever else the model or the sampler raises (the worker then ends).
        """
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
                if self._oom is not None:
                    self._oom.after_good_step(plan)
            if oom_text is not None:
                self._oom_recovery().recover(plan, self.runner.stage, oom_text)
        ended = self.scheduler.drain_ended()
        outputs = [self._output(r) for r in touched if r not in ended]
        outputs.extend(self._output(r) for r in ended)
        return outputs

    def drain_events(self) -> list:
        """Engine events since the last call (``list[engine.messages.EngineEvent]``): an
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
        """The test-only fault injector (``engine.faults.FaultInjector``), the one
        ``HEADROOM_FAULTS`` configured or a new, empty one: ``engine.faults.add(site,
        request_id, times)``."""
        if self.runner.faults is None:
            from engine.faults import FaultInjector

            self.runner.faults = FaultInjector()
        return self.runner.faults

    # Made on the first out-of-memory step (``engine.oom.OomRecovery``): an engine that
    # never runs out of memory carries none of its state, and a step pays one ``is None``.
    _oom = None

    def _oom_recovery(self):
        if self._oom is None:
            from engine.oom import OomRecovery

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
        )

    def _output(self, req: Request) -> TokenOutput:
        new = req.output_ids[req.emitted :]
        req.emitted = len(req.output_ids)
        done = req.phase is Phase.FINISHED
        return TokenOutput(
            request_id=req.request_id,
            token_ids=new,
            finished=done,
            finish_reason=req.finish_reason if done else None,
            error_code=req.error_code,
            error_message=req.error_message,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.prompt_cached_tokens,
        )

    # -- live replanning (DESIGN.md, "When memory moves") ---------------------------------
    #
    # The service's VRAM watcher asks for these, cheapest first, when another process
    # takes device memory: a smaller prefill chunk cap, an empty prefix cache, a smaller
    # KV pool; and for the pool to grow back when the memory returns. Each change that
    # happens queues a ``Replanned`` event for :meth:`drain_events`. Call them between
    # steps (the engine is single-threaded).

    # Replanned events not yet drained; the list is made on the first change (an engine
    # that never replans carries none).
    _replans: list[Replanned] | None = None

    @property
    def kv_page_bytes(self) -> int:
        """Device bytes one KV page costs over all layers, keys and values."""
        return self.pool.nbytes // self.pool.num_pages

    def min_kv_pool_pages(self, context_tokens: int | None = None) -> int:
        """The smallest pool (pages, null page included) that holds one request of
        ``context_tokens`` (default: the plan's minimum context, else the model's)."""
        if context_tokens is None:
            context_tokens = self.plan.min_context_tokens if self.plan is not None else self.info.model_context_tokens
        return math.ceil(context_tokens / self.config.page_size) + 1

    def resize_kv_pool(self, num_pages: int, *, reason: str = "") -> ResizeResult:
        """Shrink or grow the KV pool to ``num_pages`` pages (null page included) while
        requests run, and give the memory back to the device.

        Shrinking keeps every running request whose context still fits:

        1. Requests that no longer fit in the new per-request context
           (``min(model context, (num_pages - 1) * page_size)`` tokens) end: with
           ``finish_reason="length"`` when they have produced output (they stopped at the
           context limit, as on a pool of that size from the start; what was streamed
           stays valid), else with ``error_code="out_of_memory"`` (their prompt alone no
           longer fits; the service answers 503 with Retry-After: the memory was taken
           by another process and may come back, so "retry later" is the honest answer,
           where ``context_length_exceeded`` would blame the prompt). Requests that wait
           are held to the same rule, so none waits forever for room that is gone (F5).
        2. Unreferenced prefix-cache pages at or above the cut are evicted.
        3. Live pages at or above the cut (a request's own, or the prefix cache's, shared
           or not) are copied into free pages below it, and every reference (the requests'
           page lists, the radix nodes) is renamed. When there are not enough free pages
           below the cut, least recently used cache pages are evicted, then the youngest
           running requests are preempted (their computed pages stay cached while room
           allows; they are recomputed later, so greedy outputs do not change).
        4. The allocator and the pool shrink, layer by layer (:meth:`KVPool.resize`).

        Growing adds free pages at the top and raises the context limit back.

        Returns:
            What was done; a :class:`engine.messages.Replanned` event with the same
            figures is queued for :meth:`drain_events`.

        Raises:
            ValueError: ``num_pages < 2``.
            torch.OutOfMemoryError: a new buffer did not fit (growing, or shrinking on
                a full device); the pool then stays consistent at the smaller size
                (see :meth:`KVPool.resize`) and the engine keeps running.
        """
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        started = time.perf_counter()
        before_pages, before_bytes = self.pool.num_pages, self.pool.nbytes
        evicted = relocated = 0
        preempted: list[str] = []
        ended: list[str] = []
        if num_pages < before_pages:
            self._set_context_limit(num_pages)
            ended = self._end_beyond_context()
            evicted, relocated, preempted = self._vacate(num_pages)
            self.allocator.resize(num_pages)
            self.runner.pool_will_move()
            try:
                self.pool.resize(num_pages)
            finally:
                self._pool_resized()
        elif num_pages > before_pages:
            self.runner.pool_will_move()
            try:
                self.pool.resize(num_pages)
            finally:
                # After a failed grow the pool is consistent at its old size.
                self.allocator.resize(self.pool.num_pages)
                self._set_context_limit(self.pool.num_pages)
                self._pool_resized()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result = ResizeResult(
            before_pages=before_pages,
            after_pages=self.pool.num_pages,
            before_bytes=before_bytes,
            after_bytes=self.pool.nbytes,
            evicted_pages=evicted,
            relocated_pages=relocated,
            preempted=preempted,
            ended=ended,
            max_context_tokens=self.max_context_tokens,
            duration_ms=(time.perf_counter() - started) * 1000,
        )
        if result.after_pages != before_pages:
            log.info(
                "KV pool %s: %d -> %d pages (%.1f -> %.1f MiB) in %.1f ms; %d evicted, %d moved, "
                "%d preempted, %d ended; context limit %d tokens%s",
                "shrunk" if result.after_pages < before_pages else "grown", before_pages,
                result.after_pages, before_bytes / 2**20, result.after_bytes / 2**20,
                result.duration_ms, evicted, relocated, len(preempted), len(ended),
                self.max_context_tokens, f" ({reason})" if reason else "",
            )
            self._replanned(
                REPLAN_RESIZE_POOL, reason, before_pages, before_bytes, result.duration_ms,
                evicted_pages=evicted, relocated_pages=relocated, preempted=preempted, ended=ended,
            )
        return result

    def set_prefill_chunk(self, max_prefill_tokens: int, *, reason: str = "") -> int:
        """Set the engine-wide prefill chunk cap (new tokens per step), at most what the
        memory plan fitted (``knobs.max_prefill_tokens``: a larger chunk's activation
        peak was never budgeted). A smaller cap lowers the step's transient memory (on
        CUDA the allocator's cache is emptied, so the device sees it at once); a cap
        below the number of running requests leaves no room for prefill next to their
        decodes, so the service keeps it at 256 or more (``MIN_PREFILL_TOKENS``).

        Returns:
            The cap now in force. A ``Replanned`` event is queued when it changed.

        Raises:
            ValueError: ``max_prefill_tokens < 1``.
        """
        if max_prefill_tokens < 1:
            raise ValueError(f"the prefill chunk cap must be >= 1 token, got {max_prefill_tokens}")
        before = self.scheduler.max_prefill_tokens
        after = min(max_prefill_tokens, self.knobs.max_prefill_tokens)
        self.scheduler.max_prefill_tokens = after
        if after < before and self.device.type == "cuda":
            # The larger steps' activation blocks sit in the allocator's cache: give them
            # back, or the device sees no change.
            torch.cuda.empty_cache()
        if after != before:
            log.info("prefill chunk cap %d -> %d tokens%s", before, after, f" ({reason})" if reason else "")
            self._replanned(REPLAN_PREFILL_CHUNK, reason, self.pool.num_pages, self.pool.nbytes, 0.0)
        return after

    def evict_prefix_cache(self, *, reason: str = "") -> int:
        """Free every prefix-cache page no running request uses.

        Returns:
            Pages freed. A ``Replanned`` event is queued when some were.
        """
        if self.radix is None:
            return 0
        started = time.perf_counter()
        freed = self.radix.clear()
        if freed:
            log.info("prefix cache: %d pages evicted%s", freed, f" ({reason})" if reason else "")
            self._replanned(
                REPLAN_EVICT_PREFIX_CACHE, reason, self.pool.num_pages, self.pool.nbytes,
                (time.perf_counter() - started) * 1000, evicted_pages=freed,
            )
        return freed

    def _replanned(self, action: str, reason: str, before_pages: int, before_bytes: int, duration_ms: float, **extra) -> None:
        if self._replans is None:
            self._replans = []
        self._replans.append(Replanned(
            action=action, reason=reason, before_pages=before_pages, after_pages=self.pool.num_pages,
            before_bytes=before_bytes, after_bytes=self.pool.nbytes, duration_ms=duration_ms,
            max_prefill_tokens=self.scheduler.max_prefill_tokens,
            max_context_tokens=self.max_context_tokens, **extra,
        ))

    def _set_context_limit(self, num_pages: int) -> None:
        """The per-request context limit for a pool of ``num_pages`` (null page included)."""
        ctx = min(self.info.model_context_tokens, (num_pages - 1) * self.config.page_size)
        self.max_context_tokens = self.scheduler.max_context_tokens = ctx

    def _pool_resized(self) -> None:
        self.info = msgspec.structs.replace(
            self.info, num_pages=self.pool.num_pages, kv_cache_bytes=self.pool.nbytes,
            max_context_tokens=self.max_context_tokens,
        )

    def _end_beyond_context(self) -> list[str]:
        """End the requests that no longer fit in ``max_context_tokens`` (see
        :meth:`resize_kv_pool`, step 1); returns their ids."""
        sched, limit = self.scheduler, self.max_context_tokens
        ended = []
        for req in [*sched.running, *sched.waiting]:
            if req.total_len < limit:
                continue  # room for at least one more token
            if req.output_ids:
                sched.finish(req, FINISH_LENGTH)
            else:
                sched.fail(req, "out_of_memory", (
                    f"the KV cache shrank while this request waited or ran (another process "
                    f"took device memory): one request may now hold {limit} tokens, and its "
                    f"prompt has {len(req.prompt_ids)}; retry later, or with a shorter prompt"
                ))
            ended.append(req.request_id)
        return ended

    def _vacate(self, cut: int) -> tuple[int, int, list[str]]:
        """Make every page at or above ``cut`` free (see :meth:`resize_kv_pool`, steps 2
        and 3); returns (pages evicted, pages moved, ids of preempted requests)."""
        sched, alloc, radix = self.scheduler, self.allocator, self.radix
        evicted = radix.evict_at_or_above(cut) if radix is not None else 0
        preempted: list[str] = []
        while True:
            high = self._live_pages_at_or_above(cut)
            short = len(high) - alloc.free_below(cut)
            if short <= 0:
                break
            got = radix.evict(short) if radix is not None else 0
            evicted += got
            if got:
                continue
            if not sched.running:
                raise RuntimeError(f"pages at or above {cut} are held, but by no running request")
            victim = max(sched.running, key=lambda r: r.arrival)
            sched.preempt(victim)
            preempted.append(victim.request_id)
            if radix is not None:
                # Its pages went to the prefix cache; those above the cut can go now.
                evicted += radix.evict_at_or_above(cut)
        if high:
            dst = alloc.alloc_below(len(high), cut)
            moved = dict(zip(high, dst, strict=True))
            self.pool.copy_pages(high, dst)
            for req in sched.running:
                if any(p in moved for p in req.pages):
                    req.pages = [moved.get(p, p) for p in req.pages]
            if radix is not None:
                radix.remap(moved)
            alloc.free(high)
        if preempted:
            log.info("KV pool shrink to %d pages: preempted %s (youngest first)", cut, ", ".join(preempted))
        return evicted, len(high), preempted

    def _live_pages_at_or_above(self, cut: int) -> list[int]:
        """Pages at or above ``cut`` that a running request or the prefix cache holds."""
        live = {p for req in self.scheduler.running for p in req.pages if p >= cut}
        if self.radix is not None:
            live.update(p for p in self.radix.all_pages() if p >= cut)
        return sorted(live)
