"""Triton sampling kernels; references and the parameter layout in :mod:`kernels.sampling.reference`.

Each row is cut in chunks of up to ``_BLOCK`` tokens, one program per (row, chunk), so
even a single row spreads over the GPU; a chunk's partial result (max, or best score
and its token) goes to a small ``[B, chunks]`` buffer that the next launch reduces. The
vocabulary size is a compile-time constant (one build per model). :func:`top_k_top_p` is the
reference's own (torch's segmented sort), re-exported so the three functions come from
one module.

Randomness: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC 2011) through ``tl.rand``, keyed by the row's seed with the 64-bit counter
``step * 2^32 + token``: each (seed, step) has its own stream, one uniform per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling.reference import (
    FREQUENCY,
    INVALID_TOKEN,
    MIN_P,
    NUM_FPARAMS,
    NUM_IPARAMS,
    PRESENCE,
    REPETITION,
    SEED,
    STEP,
    TEMPERATURE,
    top_k_top_p,
)

_BLOCK = 4096

__all__ = ["penalize_and_scale", "top_k_top_p", "draw"]


@triton.jit
def _penalized(logits_ptr, counts_ptr, prompt_ptr, row, cols, mask, V, rep, presence, freq,
               HAS_PENALTY: tl.constexpr, HAS_PROMPT: tl.constexpr):
    x = tl.load(logits_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_PENALTY:
        c = tl.load(counts_ptr + row * V + cols, mask=mask, other=0)
        seen = c > 0
        if HAS_PROMPT:
            seen = seen | (tl.load(prompt_ptr + row * V + cols, mask=mask, other=0) != 0)
        x = tl.where(seen, tl.where(x < 0, x * rep, tl.math.div_rn(x, rep)), x)
        delta = c.to(tl.float32) * freq + (c > 0).to(tl.float32) * presence
        x = x - delta
    return x


@triton.jit
def _penalize_kernel(
    logits_ptr, counts_ptr, prompt_ptr, fparams_ptr, out_ptr, part_max_ptr, V: tl.constexpr,
    C: tl.constexpr, NF: tl.constexpr, HAS_PENALTY: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(B, C)``: penalize one chunk of a row, store it and the chunk's max."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    rep = tl.load(fparams_ptr + row * NF + 3)
    presence = tl.load(fparams_ptr + row * NF + 4)
    freq = tl.load(fparams_ptr + row * NF + 5)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = _penalized(logits_ptr, counts_ptr, prompt_ptr, row, cols, mask, V, rep, presence, freq,
                   HAS_PENALTY, HAS_PROMPT)
    tl.store(out_ptr + row * V + cols, x, mask=mask)
    nans = tl.sum((x != x).to(tl.int32), axis=0)
    best = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    tl.store(part_max_ptr + row * C + chunk, tl.where(nans > 0, float("nan"), best))


@triton.jit
def _row_max(part_max_ptr, row, C: tl.constexpr, C_BLOCK: tl.constexpr):
    """Max of a row's chunk maxima, NaN if any chunk held a NaN."""
    offs = tl.arange(0, C_BLOCK)
    pm = tl.load(part_max_ptr + row * C + offs, mask=offs < C, other=float("-inf"))
    nans = tl.sum((pm != pm).to(tl.int32), axis=0)
    return tl.where(nans > 0, float("nan"), tl.max(tl.where(pm != pm, float("-inf"), pm), axis=0))


@triton.jit
def _scale_kernel(
    x_ptr, part_max_ptr, fparams_ptr, row_max_ptr, V: tl.constexpr, C: tl.constexpr,
    C_BLOCK: tl.constexpr, NF: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(B, C)``: shift a sampled row's chunk by the row max and divide by the
    temperature, in place; greedy rows are left as they are."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    best = _row_max(part_max_ptr, row, C, C_BLOCK)
    if chunk == 0:
        tl.store(row_max_ptr + row, best)
    temp = tl.load(fparams_ptr + row * NF + 0)
    if temp > 0:
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_ptr + row * V + cols, mask=mask)
        tl.store(x_ptr + row * V + cols, tl.math.div_rn(x - best, temp), mask=mask)


@triton.jit
def _draw_chunk_kernel(
    x_ptr, fparams_ptr, iparams_ptr, part_score_ptr, part_idx_ptr, filtered_ptr,
    V: tl.constexpr, C: tl.constexpr, NF: tl.constexpr, NI: tl.constexpr,
    WRITE_FILTERED: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(B, C)``: min-p and the race over one chunk; stores the chunk's winner."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(fparams_ptr + row * NF + 0)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * V + cols, mask=mask, other=float("-inf"))
    if temp > 0:
        min_p = tl.load(fparams_ptr + row * NF + 2)
        seed = tl.load(iparams_ptr + row * NI + 1)
        step = tl.load(iparams_ptr + row * NI + 2)
        # Sampled rows were shifted so that their best token is at 0: p_j / p_max = exp(x_j).
        kept = tl.where(tl.exp(x) < min_p, float("-inf"), x)
        # argmax p_j / E_j with E_j = -log(u_j) ~ Exp(1); u is kept off 0 so that the
        # best token can never lose to nothing, and E off 0 (the reference clamps E the
        # same way): on the GPU tl.log is approximate and gives 0 for the u just below 1,
        # where an unclamped E makes a removed token's score -inf + inf = NaN, which
        # argmax picks, a token the grammar mask or a filter had taken out.
        u = tl.maximum(tl.rand(seed, (step << 32) + cols.to(tl.int64)), 1e-30)
        e = tl.maximum(-tl.log(u), 1.1754943508222875e-38)  # float32's smallest normal
        score = tl.where(kept == float("-inf"), float("-inf"), kept - tl.log(e))
    else:
        kept = x
        score = x
    if WRITE_FILTERED:
        tl.store(filtered_ptr + row * V + cols, kept, mask=mask)
    score = tl.where(mask, score, float("-inf"))
    tl.store(part_score_ptr + row * C + chunk, tl.max(score, axis=0))
    # first index among ties, as torch.argmax
    tl.store(part_idx_ptr + row * C + chunk, tl.argmax(score, axis=0).to(tl.int64) + chunk * BLOCK)


@triton.jit
def _draw_final_kernel(
    part_score_ptr, part_idx_ptr, row_max_ptr, out_ptr, C: tl.constexpr, C_BLOCK: tl.constexpr,
    INVALID: tl.constexpr,
):
    """Grid ``(B,)``: the winner over the chunks (the earliest chunk among ties)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_BLOCK)
    valid = offs < C
    score = tl.load(part_score_ptr + row * C + offs, mask=valid, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * C + offs, mask=valid, other=0)
    win = tl.argmax(score, axis=0)
    token = tl.sum(tl.where(offs == win, idx, 0), axis=0)
    row_max = tl.load(row_max_ptr + row)
    finite = (row_max == row_max) & (row_max != float("inf")) & (row_max != float("-inf"))
    tl.store(out_ptr + row, tl.where(finite, token, INVALID))


def _chunks(V: int) -> tuple[int, int, int]:
    """(BLOCK, C, C_BLOCK): the chunk width, chunks per row and their power-of-2 pad."""
    block = min(_BLOCK, triton.next_power_of_2(V))
    c = triton.cdiv(V, block)
    return block, c, triton.next_power_of_2(c)


def penalize_and_scale(
    logits: torch.Tensor,
    fparams: torch.Tensor,
    counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.sampling.reference.penalize_and_scale`; two launches."""
    B, V = logits.shape
    logits = logits.contiguous()
    out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    row_max = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return out, row_max
    block, c, c_block = _chunks(V)
    part_max = torch.empty((B, c), dtype=torch.float32, device=logits.device)
    has_penalty = counts is not None
    has_prompt = has_penalty and prompt_mask is not None
    prompt = prompt_mask.view(torch.uint8) if has_prompt else out
    fparams = fparams.contiguous()
    _penalize_kernel[(B, c)](
        logits, counts if has_penalty else out, prompt, fparams, out, part_max, V,
        C=c, NF=NUM_FPARAMS, HAS_PENALTY=has_penalty, HAS_PROMPT=has_prompt, BLOCK=block,
        num_warps=4,
    )
    _scale_kernel[(B, c)](
        out, part_max, fparams, row_max, V, C=c, C_BLOCK=c_block, NF=NUM_FPARAMS, BLOCK=block,
        num_warps=4,
    )
    return out, row_max


def draw(
    x: torch.Tensor,
    row_max: torch.Tensor,
    fparams: torch.Tensor,
    iparams: torch.Tensor,
    filtered: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.sampling.reference.draw`; two launches."""
    B, V = x.shape
    tokens = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return tokens
    block, c, c_block = _chunks(V)
    part_score = torch.empty((B, c), dtype=torch.float32, device=x.device)
    part_idx = torch.empty((B, c), dtype=torch.int64, device=x.device)
    _draw_chunk_kernel[(B, c)](
        x.contiguous(), fparams.contiguous(), iparams.contiguous(), part_score, part_idx,
        filtered if filtered is not None else x, V,
        C=c, NF=NUM_FPARAMS, NI=NUM_IPARAMS, WRITE_FILTERED=filtered is not None, BLOCK=block,
        num_warps=4,
    )
    _draw_final_kernel[(B,)](
        part_score, part_idx, row_max, tokens, C=c, C_BLOCK=c_block, INVALID=INVALID_TOKEN,
        num_warps=1,
    )
    return tokens


# The kernels index the packed columns by number; keep them in step with the layout.
assert (TEMPERATURE, MIN_P, REPETITION, PRESENCE, FREQUENCY) == (0, 2, 3, 4, 5)
assert (SEED, STEP) == (1, 2)
