"""The profile run: one dummy step at the largest size the plan admits, measured; and
the warm-up of a fresh prompt's shapes (:func:`warm_up_fresh_prompts`).

On CUDA, the allocator's peak statistics give the transient bytes of a step with
``max_prefill_tokens`` new tokens spread over ``max_running_requests`` sequences at the
longest context, plus sampling of every row through the sort path. The blocks it
leaves in the caching allocator stay reserved, so later steps of that size reuse them
instead of asking the device again: the step-size buffers are allocated once, here.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from engine.common.forward_batch import ForwardBatch
from engine.core.footprint import model_context
from engine.kvcache.pool import KVPool
from engine.layers.attention.base import AttentionBackend
from engine.memory.plan import PlanKnobs
from engine.sampling.sampler import Sampler
from engine.sampling.state import SamplingState
from engine.wire.messages import SamplingParams


def profile_batch(num_tokens: int, num_seqs: int, context: int, page_size: int, num_pages: int, device,
                  ring_pages: int = 0) -> ForwardBatch:
    """A worst-case step: ``num_seqs - 1`` decode rows and one prefill chunk of the
    remaining tokens, every sequence ``context`` tokens long after the step. Page tables
    cycle through the ``num_pages - 1`` pages of a small pool: the keys read are
    garbage, the shapes are real. ``ring_pages``: the sliding layers' ring pool, whose
    page table cycles through its pages alike (0: no ring)."""
    chunk = num_tokens - (num_seqs - 1)
    extend = [1] * (num_seqs - 1) + [chunk]
    prefix = [context - e for e in extend]
    max_pages = math.ceil(context / page_size)
    table = (torch.arange(max_pages) % (num_pages - 1) + 1).repeat(num_seqs, 1)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)])
    slots = table[0][positions // page_size] * page_size + positions % page_size
    ring = (torch.arange(max_pages) % max(ring_pages - 1, 1) + 1).repeat(num_seqs, 1)
    ring_slots = ring[0][positions // page_size] * page_size + positions % page_size
    return ForwardBatch(
        is_decode=False,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=positions.to(device),
        out_slots=slots.to(device),
        page_table=table.to(device),
        prefix_lens=torch.tensor(prefix, dtype=torch.int64),
        extend_lens=torch.tensor(extend, dtype=torch.int64),
        logits_indices=(torch.cumsum(torch.tensor(extend), 0) - 1).to(device),
        ring_page_table=ring.to(device) if ring_pages else None,
        ring_out_slots=ring_slots.to(device) if ring_pages else None,
    )


@dataclass(frozen=True)
class StepPeak:
    """Bytes one worst-case step allocates above what was allocated before it:
    ``forward_bytes`` for the model's forward (activations, attention transients, the
    logits rows), ``sampler_bytes`` for sampling those rows: the per-request penalty
    state plus what the sampling raises the step's peak by, over the forward's (its
    transients first reuse the blocks the forward freed). The step's peak is the sum."""

    forward_bytes: int
    sampler_bytes: int


@torch.inference_mode()
def measure_step_peak(
    model: torch.nn.Module,
    attn: AttentionBackend,
    pool: KVPool,
    knobs: PlanKnobs,
    max_position_embeddings: int,
    vocab_size: int | None = None,
) -> StepPeak:
    """Run one worst-case step over ``pool`` and measure it (CUDA only).

    Each part is the larger of the allocator's peak allocated and peak reserved growth,
    so rounding into fresh segments is charged too. The blocks stay cached afterwards:
    run over the real pool, this is the warm-up that leaves the step-size buffers
    allocated once. ``vocab_size`` is the logits' width (the whole vocabulary; under
    tensor parallelism the model's own config holds its rank's shard); default: the
    model config's.

    Raises:
        torch.OutOfMemoryError: the step itself does not fit on the device.
        ValueError: ``pool`` is not on a CUDA device.
    """
    device = pool.device
    if device.type != "cuda":
        raise ValueError("the profile run measures CUDA allocations; estimate on other devices")
    ctx = min(max_position_embeddings, knobs.max_model_len or max_position_embeddings)
    tokens = min(knobs.max_prefill_tokens, ctx)
    seqs = max(min(knobs.max_running_requests, tokens), 1)
    batch = profile_batch(tokens, seqs, ctx, pool.page_size, pool.num_pages, device, pool.ring_pages)
    vocab = vocab_size or model.config.vocab_size
    bound = None
    if model.config.is_hybrid:
        # The state pool is a ledger line of its own: made before the window opens, so
        # the window measures the linear-attention layers' transient only.
        from engine.kvcache.state_pool import StatePool

        bound = model.states
        model.bind_states(StatePool(model.config, seqs, pool.compute_dtype, device))
        batch.state_slots = torch.arange(1, seqs + 1)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, frequency_penalty=0.1, seed=0)

    def snapshot():
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    def peak_since(alloc, reserved):
        torch.cuda.synchronize(device)
        return max(torch.cuda.max_memory_allocated(device) - alloc, torch.cuda.max_memory_reserved(device) - reserved)

    # The requests' sampling state (penalty counts, prompt masks) lives as long as they
    # do, through the forward too: made first, charged whole.
    alloc, reserved = snapshot()
    states = [SamplingState(sp, [0], vocab, device) for _ in range(seqs)]
    state_bytes = max(snapshot()[0] - alloc, 0)
    # One window over the forward and the sampling: the sampler's transients reuse
    # blocks the forward freed (the logits rows stay), so the step's peak is what the
    # two need together, not their sum.
    alloc, reserved = snapshot()
    torch.cuda.reset_peak_memory_stats(device)
    host = getattr(model, "host_layers", None)  # --cpu-layers: their CPU work is not measured
    with host.device_only_steps() if host is not None else contextlib.nullcontext():
        logits = model(batch, attn)
    forward_bytes = peak_since(alloc, reserved)
    Sampler().sample(logits, states, [sp] * seqs)
    step_bytes = peak_since(alloc, reserved)
    sampler_bytes = state_bytes + max(step_bytes - forward_bytes, 0)
    if model.config.is_hybrid:
        model.bind_states(bound)
    return StepPeak(forward_bytes=forward_bytes, sampler_bytes=sampler_bytes)


# A fresh prompt's length for :func:`warm_up_fresh_prompts`: no power of two divides it
# (Triton compiles an integer argument divisible by 16 apart from one that is not).
WARM_UP_PROMPT_TOKENS = 37


@torch.inference_mode()
def warm_up_fresh_prompts(model: torch.nn.Module, attn: AttentionBackend, pool: KVPool) -> int:
    """Run the prefill shapes a first request meets that the profile step does not, so
    their kernels compile before the service is ready rather than in the first answers
    (on an H100, a first start's first request of 61 tokens waited 17.5 s for them): a
    fresh sequence of :data:`WARM_UP_PROMPT_TOKENS` tokens alone, and beside a decode row
    (a new request joining one that decodes). The profile step's sequences all have a
    prefix and its chunk a length divisible by 16; a fresh sequence takes other paths
    (attention without a prefix, a linear-attention layer's zero initial state). Nothing
    is sampled; the keys written go to pages no request holds yet, and a hybrid model's
    states to a pool of its own, as in :func:`measure_step_peak`.

    Returns:
        The forwards run (2).
    """
    n = WARM_UP_PROMPT_TOKENS
    runs = 0
    for seqs in (1, 2):
        batch = profile_batch(n + seqs - 1, seqs, n, pool.page_size, pool.num_pages, pool.device, pool.ring_pages)
        bound = None
        if model.config.is_hybrid:
            from engine.kvcache.state_pool import StatePool

            bound = model.states
            model.bind_states(StatePool(model.config, seqs, pool.compute_dtype, pool.device))
            batch.state_slots = torch.arange(1, seqs + 1)
        host = getattr(model, "host_layers", None)
        with host.device_only_steps() if host is not None else contextlib.nullcontext():
            model(batch, attn)
        if model.config.is_hybrid:
            model.bind_states(bound)
        runs += 1
    return runs


def profile_pool_pages(knobs: PlanKnobs) -> int:
    """Pages of the small pool the profile run writes into (the chunk's pages + null)."""
    return math.ceil(knobs.max_prefill_tokens / knobs.page_size) + 2


__all__ = ["StepPeak", "measure_step_peak", "profile_batch", "profile_pool_pages", "model_context",
           "warm_up_fresh_prompts"]
