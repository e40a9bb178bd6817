"""The model runner: turns a planned step into tensors, runs the model, samples.

The step loop on a GPU: the step's integers go to the device in one copy from pinned
memory (:class:`engine.core.step_inputs.StepInputs`), a decode step replays a CUDA graph when
one is captured for its (padded) batch size (:class:`engine.core.cuda_graphs.DecodeGraphs`),
one sequence's prefill chunk one captured for its padded length
(:class:`engine.core.prefill_graphs.PrefillGraphs`),
and the only host sync is reading the sampled ids back. A replayed step whose requests
are all greedy, unpenalized and unmasked (no grammar, no forced token) takes the ids
the graph picked (no sampling launch).
"""

from __future__ import annotations

import torch

from engine.common.faults import FaultInjector
from engine.common.forward_batch import ForwardBatch
from engine.core.cuda_graphs import DecodeGraphs
from engine.core.prefill_graphs import PrefillGraphs
from engine.core.step_inputs import StepInputs
from engine.kvcache.pool import KVPool
from engine.layers.attention.base import AttentionBackend
from engine.layers.moe.offload import after_forward, before_forward
from engine.sampling.logprobs import token_logprobs
from engine.sampling.sampler import INVALID_LOGITS_MESSAGE, InvalidLogitsError, Sampler
from engine.sampling.state import all_plain_greedy
from engine.scheduler.request import Phase
from engine.scheduler.scheduler import StepPlan
from engine.wire.messages import TokenLogprobs


class ModelRunner:
    """Runs one step of a model over the paged KV pool.

    Args:
        model: a ``CausalLM`` (``forward(batch, attn) -> [S, V]`` float32 logits).
        pool, attn: the KV pool and the attention backend over it.
        expert_stores: the model's layers whose routed experts live in host memory
            (their bookkeeping runs around each forward, outside any graph).

    Attributes:
        stage: ``"forward"`` or ``"sample"``, the part of the last :meth:`run` that ran
            last; after an exception, where it was raised.
        faults: the test-only :class:`engine.common.faults.FaultInjector`, from
            ``HEADROOM_FAULTS`` at construction, else None (see ``Engine.faults``).
        graphs: the decode step's CUDA graphs (:meth:`enable_cuda_graphs`), else None.
        prefill_graphs: one sequence's prefill chunk's CUDA graphs
            (:meth:`enable_prefill_graphs`), else None.
        replayed: whether the last :meth:`forward` replayed a decode graph.
        logprobs: ``{request_id: TokenLogprobs}`` of the last :meth:`run`'s sampled
            tokens, for the requests that asked (``SamplingParams.logprobs``).
        prompt_logprobs: ``{request_id: [(prompt position, TokenLogprobs)]}`` of the
            last run's scored prompt chunks (``SamplingParams.prompt_logprobs``).

    Raises (constructor):
        ValueError: a malformed ``HEADROOM_FAULTS``.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, attn: AttentionBackend, device: torch.device,
                 expert_stores: list | None = None) -> None:
        self.model = model
        self.expert_stores = expert_stores or []
        self.pool = pool
        self.attn = attn
        self.device = device
        self.sampler = Sampler()
        self.stage = "forward"
        self.faults: FaultInjector | None = FaultInjector.from_env()
        self.inputs = StepInputs(device, pool.page_size, ring=bool(pool.ring_layers))
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.replayed = False
        self.logprobs: dict[str, TokenLogprobs] = {}
        self.prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = {}

    def enable_cuda_graphs(self, *, max_batch: int, max_context_tokens: int) -> int:
        """Capture the decode step at every size up to ``max_batch`` (CUDA, and a backend
        with ``supports_cuda_graphs``); returns the device bytes the capture took.

        Raises:
            ValueError: not on CUDA, or the backend cannot be captured.
            torch.OutOfMemoryError: the capture did not fit.
        """
        if self.device.type != "cuda" or not self.attn.supports_cuda_graphs:
            raise ValueError(f"CUDA graphs need a CUDA device and a backend that supports them "
                             f"(device {self.device}, backend {type(self.attn).__name__})")
        self.graphs = DecodeGraphs(self.model, self.attn, self.device, page_size=self.pool.page_size,
                                   max_batch=max_batch, max_context_tokens=max_context_tokens,
                                   ring=bool(self.pool.ring_layers), states=self.model.config.is_hybrid)
        before_forward(self.expert_stores, 0)  # the warm-ups' dummy rows heat no expert
        return self.graphs.capture_all()

    def enable_prefill_graphs(self, *, max_tokens: int, max_context_tokens: int) -> int:
        """Capture one sequence's prefill chunk at every size up to ``max_tokens``
        (:mod:`engine.core.prefill_graphs`: dense models, after :meth:`enable_cuda_graphs`,
        whose memory pool they share); returns the device bytes the capture took.

        A model whose extend cannot be captured (its forward reads back from the device:
        :meth:`engine.core.prefill_graphs.PrefillGraphs.capturable`) keeps prefilling
        eagerly, logged, and this returns 0.

        Raises:
            ValueError: the backend plans on the host, or no decode graphs.
            torch.OutOfMemoryError: the capture did not fit.
        """
        if self.graphs is None:
            raise ValueError("prefill graphs come after the decode graphs (enable_cuda_graphs)")
        graphs = PrefillGraphs(self.model, self.attn, self.device, page_size=self.pool.page_size,
                               max_tokens=max_tokens, max_context_tokens=max_context_tokens,
                               shared_pool=self.graphs.memory_pool, ring=bool(self.pool.ring_layers))
        taken = graphs.capture_all()
        if taken is None:
            return 0
        self.prefill_graphs = graphs
        return taken

    def pool_will_move(self) -> None:
        """The KV pool's buffers (or the expert caches') are about to be replaced (a
        resize): captured graphs hold their addresses, so drop them; they are captured
        again on next use."""
        if self.graphs is not None:
            self.graphs.invalidate()
        if self.prefill_graphs is not None:
            self.prefill_graphs.invalidate()

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        """Flatten the plan's chunks into one ragged batch (see :class:`ForwardBatch`)."""
        batch = self.inputs.build(plan.items, plan.is_decode)
        if plan.items and plan.items[0].req.state_slot is not None:  # a hybrid model's requests
            batch.state_slots = torch.tensor([it.req.state_slot for it in plan.items], dtype=torch.int64)
        return batch

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """``[S, V]`` float32 logits of the plan's sampling rows: a graph replay for a
        decode step of a captured size (``replayed`` then True) or for one sequence's
        prefill chunk that fits a prefill graph, else the model run eagerly."""
        self.replayed = False
        if self.graphs is not None and plan.is_decode:
            before_forward(self.expert_stores, len(plan.items))
            logits = self.graphs.run(plan.items)
            if logits is not None:
                self.replayed = True
                after_forward(self.expert_stores, self.graphs.size_for(len(plan.items)))
                return logits
        if self.prefill_graphs is not None and not plan.is_decode:
            logits = self.prefill_graphs.run(plan.items)
            if logits is not None:
                return logits
        batch = self.build_batch(plan)
        before_forward(self.expert_stores, len(batch.input_ids))
        logits = self.model(batch, self.attn)
        after_forward(self.expert_stores, len(batch.input_ids))
        if batch.sample_rows is None:
            return logits
        self.prompt_logprobs = self._score_prompts(plan, logits)
        return logits.index_select(0, batch.sample_rows.to(logits.device))

    @staticmethod
    def _score_prompts(plan: StepPlan, logits: torch.Tensor) -> dict[str, list[tuple[int, TokenLogprobs]]]:
        """The logprobs of the prompt tokens the plan's scored chunks predict:
        ``{request_id: [(prompt position, record)]}``. ``logits`` has every row of a
        scored chunk and the last row of any other sampling chunk, in plan order (see
        :meth:`engine.core.step_inputs.StepInputs.build`); the row at position ``p``
        predicts the token at ``p + 1``."""
        rows, targets, ks, owners = [], [], [], []
        at = 0
        for it in plan.items:
            if it.scores:
                prompt = it.req.prompt_ids
                for p in range(it.start, it.start + it.num_tokens):
                    if p + 1 < len(prompt):
                        rows.append(at + p - it.start)
                        targets.append(prompt[p + 1])
                        ks.append(it.req.sampling.prompt_logprobs)
                        owners.append((it.req.request_id, p + 1))
                at += it.num_tokens
            elif it.samples:
                at += 1
        out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        if not rows:
            return out
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        found = token_logprobs(logits.index_select(0, index), torch.tensor(targets), ks)
        for (rid, position), record in zip(owners, found, strict=True):
            out.setdefault(rid, []).append((position, record))
        return out

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> dict[str, int]:
        """Forward the step and sample; returns ``{request_id: token}`` for sampling items.

        Leaves no trace in request state: the scheduler commits or rolls back. When
        sampling fails, the random generators it advanced are put back, so a retried
        step draws the same tokens.

        Raises:
            torch.OutOfMemoryError: in the forward or in sampling (``stage`` says which);
                real, or injected by ``faults``.
        """
        faults = self.faults
        self.logprobs, self.prompt_logprobs, self.unusable = {}, {}, {}
        self.stage = "forward"
        logits = self.forward(plan)  # [S, V] float32
        if faults is not None:
            self._inject_forward(faults, plan)
        sampling = [it.req for it in plan.items if it.samples]
        if not sampling:
            return {}
        self.stage = "sample"
        states = [r.state for r in sampling]
        params = [r.sampling for r in sampling]
        # Greedy rows never touch their generator; snapshot only the others (a CPU copy
        # of the generator state, no device sync).
        saved = [(s.generator, s.generator.get_state()) for s, p in zip(states, params, strict=True) if not p.greedy]
        wanted = [p.logprobs is not None for p in params]
        records: list[TokenLogprobs | None] | None = [] if any(wanted) else None
        try:
            if (self.replayed and len(sampling) == len(plan.items) and all_plain_greedy(params)
                    and records is None and not any(s.constrained for s in states)):
                # Every row of a decode step takes its argmax, which the graph computed.
                tokens = self.sampler.read_tokens(self.graphs.greedy_tokens(len(sampling)))
            else:
                tokens = self._sample_usable(logits, sampling, states, params, records)
            if faults is not None:
                faults.check("sample", [r.request_id for r in sampling])
            picked = tokens.tolist()
        except torch.OutOfMemoryError:
            for gen, state in saved:
                gen.set_state(state)
            raise
        usable = [r for r in sampling if r.request_id not in self.unusable]
        if records is not None:
            self.logprobs = {r.request_id: rec for r, rec in zip(usable, records, strict=True) if rec is not None}
        return {r.request_id: int(t) for r, t in zip(usable, picked, strict=True)}

    def _sample_usable(self, logits: torch.Tensor, sampling: list, states: list, params: list,
                       records: list | None) -> torch.Tensor:
        """One token per row of ``sampling``; rows whose logits cannot be sampled from
        (NaN, +inf, all -inf after penalties: :class:`InvalidLogitsError`) are left out
        and named in ``self.unusable`` (the engine fails those requests), the others
        sampled again: ``[rows of sampling not in unusable]``."""
        self.unusable = {}
        try:
            return self.sampler.sample(logits, states, params, records)
        except InvalidLogitsError as exc:
            bad = set(exc.rows)
            self.unusable = {sampling[i].request_id: INVALID_LOGITS_MESSAGE for i in bad}
            keep = [i for i in range(len(sampling)) if i not in bad]
            if records is not None:
                records.clear()
            if not keep:
                return torch.empty(0, dtype=torch.long)
            index = torch.tensor(keep, device=logits.device)
            return self.sampler.sample(logits.index_select(0, index), [states[i] for i in keep],
                                       [params[i] for i in keep], records)

    @staticmethod
    def _inject_forward(faults: FaultInjector, plan: StepPlan) -> None:
        """The ``slow``, ``prefill`` and ``decode`` sites: after the forward wrote the step's KV."""
        faults.check("slow", [it.req.request_id for it in plan.items])
        faults.check("prefill", [it.req.request_id for it in plan.items if it.req.phase is Phase.PREFILL])
        faults.check("decode", [it.req.request_id for it in plan.items if it.req.phase is Phase.DECODE])
