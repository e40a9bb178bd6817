"""Triton sampling kernels; references and the parameter layout in :mod:`kernels.sampling`.

One program per row walks the vocabulary in blocks (the vocabulary size is a
compile-time constant: one build per model), so a row costs two or three passes
over its logits and the batch no launch per row. :func:`top_k_top_p` is the
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

from kernels.sampling import (
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

_BLOCK = 2048

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
def _penalize_scale_kernel(
    logits_ptr, counts_ptr, prompt_ptr, fparams_ptr, out_ptr, row_max_ptr, V: tl.constexpr,
    NF: tl.constexpr, HAS_PENALTY: tl.constexpr, HAS_PROMPT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(fparams_ptr + row * NF + 0)
    rep = tl.load(fparams_ptr + row * NF + 3)
    presence = tl.load(fparams_ptr + row * NF + 4)
    freq = tl.load(fparams_ptr + row * NF + 5)
    best = tl.full((), float("-inf"), tl.float32)
    nans = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = _penalized(logits_ptr, counts_ptr, prompt_ptr, row, cols, mask, V, rep, presence,
                       freq, HAS_PENALTY, HAS_PROMPT)
        nans += tl.sum((x != x).to(tl.int32), axis=0)
        best = tl.maximum(best, tl.max(tl.where(x != x, float("-inf"), x), axis=0))
    best = tl.where(nans > 0, float("nan"), best)
    tl.store(row_max_ptr + row, best)
    sampled = temp > 0
    div = tl.where(sampled, temp, 1.0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = _penalized(logits_ptr, counts_ptr, prompt_ptr, row, cols, mask, V, rep, presence,
                       freq, HAS_PENALTY, HAS_PROMPT)
        scaled = tl.math.div_rn(x - best, div)
        tl.store(out_ptr + row * V + cols, tl.where(sampled, scaled, x), mask=mask)


@triton.jit
def _draw_kernel(
    x_ptr, row_max_ptr, fparams_ptr, iparams_ptr, out_ptr, filtered_ptr, V: tl.constexpr,
    NF: tl.constexpr, NI: tl.constexpr, WRITE_FILTERED: tl.constexpr, INVALID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(fparams_ptr + row * NF + 0)
    min_p = tl.load(fparams_ptr + row * NF + 2)
    seed = tl.load(iparams_ptr + row * NI + 1)
    step = tl.load(iparams_ptr + row * NI + 2)
    row_max = tl.load(row_max_ptr + row)
    sampled = temp > 0
    # Sampled rows were shifted so that their best token is at 0: p_j / p_max = exp(x_j).
    best_score = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_ptr + row * V + cols, mask=mask, other=float("-inf"))
        kept = tl.where(tl.exp(x) < min_p, float("-inf"), x)
        if WRITE_FILTERED:
            tl.store(filtered_ptr + row * V + cols, kept, mask=mask)
        u = tl.rand(seed, (step << 32) + cols.to(tl.int64))
        # log(p/E) = x - log(E) + const, E = -log(u); u == 0 gives E = inf: never picked.
        race = kept - tl.log(-tl.log(u))
        score = tl.where(sampled, race, x)
        score = tl.where(mask, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0).to(tl.int64) + start
        better = block_best > best_score  # strict: the first index wins ties, as torch.argmax
        best_idx = tl.where(better, block_idx, best_idx)
        best_score = tl.where(better, block_best, best_score)
    finite = (row_max == row_max) & (row_max != float("inf")) & (row_max != float("-inf"))
    tl.store(out_ptr + row, tl.where(finite, best_idx, INVALID))


def _block(V: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(V))


def penalize_and_scale(
    logits: torch.Tensor,
    fparams: torch.Tensor,
    counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.sampling.penalize_and_scale`; one launch."""
    B, V = logits.shape
    logits = logits.contiguous()
    out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    row_max = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return out, row_max
    has_penalty = counts is not None
    has_prompt = has_penalty and prompt_mask is not None
    prompt = prompt_mask.view(torch.uint8) if has_prompt else out
    _penalize_scale_kernel[(B,)](
        logits, counts if has_penalty else out, prompt, fparams.contiguous(), out, row_max, V,
        NF=NUM_FPARAMS, HAS_PENALTY=has_penalty, HAS_PROMPT=has_prompt, BLOCK=_block(V),
        num_warps=8,
    )
    return out, row_max


def draw(
    x: torch.Tensor,
    row_max: torch.Tensor,
    fparams: torch.Tensor,
    iparams: torch.Tensor,
    filtered: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.sampling.draw`; one launch."""
    B, V = x.shape
    tokens = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return tokens
    _draw_kernel[(B,)](
        x.contiguous(), row_max, fparams.contiguous(), iparams.contiguous(), tokens,
        filtered if filtered is not None else x, V,
        NF=NUM_FPARAMS, NI=NUM_IPARAMS, WRITE_FILTERED=filtered is not None,
        INVALID=INVALID_TOKEN, BLOCK=_block(V), num_warps=8,
    )
    return tokens


# The kernels index the packed columns by number; keep them in step with the layout.
assert (TEMPERATURE, MIN_P, REPETITION, PRESENCE, FREQUENCY) == (0, 2, 3, 4, 5)
assert (SEED, STEP) == (1, 2)
