"""The model runner: turns a planned step into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool
from engine.sampling.sampler import Sampler
from engine.scheduler.scheduler import StepPlan


class ModelRunner:
    """Runs one step of a model over the paged KV pool.

    Args:
        model: a ``CausalLM`` (``forward(batch, attn) -> [S, V]`` float32 logits).
        pool, attn: the KV pool and the attention backend over it.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, attn: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.attn = attn
        self.device = device
        self.sampler = Sampler()

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
        """Forward the step and sample; returns ``{request_id: token}`` for sampling items."""
        batch = self.build_batch(plan)
        logits = self.model(batch, self.attn)  # [S, V] float32
        sampling = [it.req for it in plan.items if it.samples]
        if not sampling:
            return {}
        tokens = self.sampler.sample(logits, [r.state for r in sampling], [r.sampling for r in sampling])
        return {r.request_id: int(t) for r, t in zip(sampling, tokens.tolist(), strict=True)}
