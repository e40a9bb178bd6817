"""The engine facade: load a model, size the KV pool, run steps.

Used in-process by ``headroom generate`` and by the worker process of ``headroom serve``.
The constructor reads top to bottom: device and dtype, model, KV pool, attention
backend, prefix cache, scheduler. A step is schedule -> forward -> commit.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from engine.attention.base import create_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.errors import RequestRejected
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.pool import KVPool
from engine.kvcache.radix import RadixCache
from engine.loader.load import load_model
from engine.loader.resolve import resolve_model
from engine.messages import EngineInfo, EngineStats, GenerateRequest, TokenOutput
from engine.runner import ModelRunner
from engine.sampling.sampler import SamplingState
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import Scheduler, SchedulerConfig

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


class Engine:
    """One model on one device, serving many requests by continuous batching.

    Single-threaded: call every method from one thread.

    Raises (constructor): the loader's ``ModelLoadError`` subclasses for a missing or
    broken model; ``ValueError`` for a bad config value.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Device and dtype.
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Model.
        self.model_dir: Path = resolve_model(config.model)
        self.model, self.model_config = load_model(self.model_dir, self.device, self.dtype)
        mc: ModelConfig = self.model_config
        # KV pool.
        num_pages = self._size_pool(mc)
        self.pool = KVPool(
            num_layers=mc.num_layers,
            num_pages=num_pages,
            page_size=config.page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        # Attention backend.
        self.attn = create_attention_backend(
            "torch", self.pool, num_heads=mc.num_heads, head_dim=mc.head_dim, scale=mc.head_dim**-0.5
        )
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
                max_prefill_tokens=config.max_prefill_tokens,
                max_context_tokens=self.max_context_tokens,
                eos_token_ids=mc.eos_token_ids,
            ),
            self.allocator,
            self.radix,
        )
        self.runner = ModelRunner(self.model, self.pool, self.attn, self.device)
        self._arrivals = itertools.count()
        self.info = EngineInfo(
            model_name=self.model_dir.name,
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
            max_prefill_tokens=config.max_prefill_tokens,
            max_running_requests=config.max_running_requests,
        )

    def _size_pool(self, mc: ModelConfig) -> int:
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        page_bytes = KVPool.bytes_per_page(
            num_layers=mc.num_layers,
            page_size=cfg.page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
        )
        budget = cfg.kv_cache_bytes if cfg.kv_cache_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES
        # Never fewer pages than one full context of the model needs (+ the null page).
        want_ctx = min(mc.max_position_embeddings, cfg.max_model_len or mc.max_position_embeddings)
        floor = math.ceil(want_ctx / cfg.page_size) + 1 if cfg.kv_cache_bytes is None else 2
        return max(budget // page_bytes, floor)

    # -- public API -----------------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request.

        Raises:
            RequestRejected: empty prompt, a prompt that leaves no room for one new token
                in ``max_context_tokens`` (code ``context_length_exceeded``), a duplicate id,
                token ids outside the vocabulary, or ``max_new_tokens < 1``.
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
        state = SamplingState(req.sampling, req.prompt_token_ids, vocab, self.device)
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
        """Run one step (schedule -> forward -> commit) and report what changed."""
        plan = self.scheduler.schedule()
        if plan is not None:
            sampled = self.runner.run(plan)
            self.scheduler.commit(plan, sampled)
            touched = [it.req for it in plan.items if it.req.request_id in sampled]
        else:
            touched = []
        ended = self.scheduler.drain_ended()
        outputs = [self._output(r) for r in touched if r not in ended]
        outputs.extend(self._output(r) for r in ended)
        return outputs

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
