"""The model runner: turns a planned step into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.faults import FaultInjector
from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool
from engine.sampling.sampler import Sampler
from engine.scheduler.request import Phase
from engine.scheduler.scheduler import StepPlan


class ModelRunner:
    """Runs one step of a model over the paged KV pool.

    Args:
        model: a ``CausalLM`` (``forward(batch, attn) -> [S, V]`` float32 logits).
        pool, attn: the KV pool and the attention backend over it.

    Attributes:
        stage: ``"forward"`` or ``"sample"``, the part of the last :meth:`run` that ran
            last; after an exception, where it was raised.
        faults: the test-only :class:`engine.faults.FaultInjector`, from
            ``HEADROOM_FAULTS`` at construction, else None (see ``Engine.faults``).

    Raises (constructor):
        ValueError: a malformed ``HEADROOM_FAULTS``.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, attn: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.attn = attn
        self.device = device
        self.sampler = Sampler()
        self.stage = "forward"
        self.faults: FaultInjector | None = FaultInjector.from_env()

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        """Flatten the plan's chunks into one ragged batch (see :class:`ForwardBatch`)."""
        ps = self.pool.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        max_pages = max(len(it.req.pages) for it in plan.items)
        page_table = torch.zeros(len(plan.items), max_pages, dtype=torch.int64)
        for b, it in enumerate(plan.items):
            req = it.req
            end = it.start + it.num_tokens
            ids.extend(req.all_ids[it.start : end])
            pos = range(it.start, end)
            positions.extend(pos)
            slots.extend(req.pages[p // ps] * ps + p % ps for p in pos)
            page_table[b, : len(req.pages)] = torch.tensor(req.pages, dtype=torch.int64)
            if it.samples:
                logits_rows.append(len(ids) - 1)
        dev = self.device
        return ForwardBatch(
            is_decode=plan.is_decode,
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            out_slots=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            page_table=page_table.to(dev, non_blocking=True),
            prefix_lens=torch.tensor([it.start for it in plan.items], dtype=torch.int64),
            extend_lens=torch.tensor([it.num_tokens for it in plan.items], dtype=torch.int64),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
        )

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
        self.stage = "forward"
        batch = self.build_batch(plan)
        logits = self.model(batch, self.attn)  # [S, V] float32
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
        try:
            tokens = self.sampler.sample(logits, states, params)
            if faults is not None:
                faults.check("sample", [r.request_id for r in sampling])
            picked = tokens.tolist()
        except torch.OutOfMemoryError:
            for gen, state in saved:
                gen.set_state(state)
            raise
        return {r.request_id: int(t) for r, t in zip(sampling, picked, strict=True)}

    @staticmethod
    def _inject_forward(faults: FaultInjector, plan: StepPlan) -> None:
        """The ``prefill`` and ``decode`` sites: after the forward wrote the step's KV."""
        faults.check("prefill", [it.req.request_id for it in plan.items if it.req.phase is Phase.PREFILL])
        faults.check("decode", [it.req.request_id for it in plan.items if it.req.phase is Phase.DECODE])
