"""Batched sampling with per-row parameters held in tensors: the torch reference.

The GPU sampler (:mod:`kernels.sampling.triton_kernel`) has the same three functions with the
same signatures; :mod:`engine.sampling.device` strings them together. Every per-row
parameter is read from a tensor, never from Python, so a step needs no host sync until
its token ids are read.

Per-row parameters are packed in two tensors of ``B`` rows (columns below):

- ``fparams``: float32 ``[B, NUM_FPARAMS]``: temperature (``0`` marks a greedy row),
  top-p floor (``1 - top_p`` computed in float64 then rounded, as the CPU sampler does;
  ``-1`` = off), min-p, repetition penalty, presence penalty, frequency penalty;
- ``iparams``: int64 ``[B, NUM_IPARAMS]``: top-k (``V`` = off), seed, step (the
  request's count of generated tokens).

The order of operations and the filters' definitions are those of
:class:`engine.sampling.sampler.Sampler` (itself transformers' order): repetition,
presence and frequency penalties; greedy rows take the argmax; other rows are shifted
by their max, divided by the temperature, then top-k, top-p, min-p, then drawn.

The draw is an exponential race, ``argmax_j(p_j / E_j)`` with ``E_j ~ Exp(1)``, whose
winner is token ``j`` with probability ``p_j``. Its uniforms come from a counter-based
generator keyed on ``(seed, step)`` alone, so a row's token does not depend on the other
rows, on where the row sits in the batch, or on a retried step. The reference keys a
``torch.Generator`` on ``(seed, step)``; the Triton kernel uses Philox with the seed as
key and ``(token, step)`` as counter. The two streams differ, so a seeded request gets
different tokens on the CPU and on the GPU (each reproducible on its own); greedy rows
are exact argmaxes on both.
"""

from __future__ import annotations

import torch

# fparams columns
TEMPERATURE, TOP_P_FLOOR, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)
NUM_FPARAMS = 6
# iparams columns
TOP_K, SEED, STEP = range(3)
NUM_IPARAMS = 3

INVALID_TOKEN = -1
"""Token id returned for a row whose penalized logits hold a NaN or ``+inf``, or are all
``-inf``: nothing can be sampled from it."""

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, to spread (seed, step) over the seed space
_MASK64 = (1 << 64) - 1


def penalize_and_scale(
    logits: torch.Tensor,
    fparams: torch.Tensor,
    counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalties, then the temperature for sampled rows.

    Repetition penalty (CTRL, Keskar et al. 2019; transformers'
    ``RepetitionPenaltyLogitsProcessor``) on tokens seen in the prompt or generated;
    then ``logit -= count * frequency + (count > 0) * presence`` (OpenAI's definition).
    Sampled rows are then shifted by their max and divided by their temperature.

    Args:
        logits: ``[B, V]`` float (upcast to float32); not modified.
        fparams: ``float32 [B, NUM_FPARAMS]``.
        counts: ``int32 [B, V]`` generated-token counts, or None when no row is penalized.
        prompt_mask: ``bool [B, V]``, True for prompt tokens, or None (with ``counts``
            None, or when no row has a repetition penalty).

    Returns:
        ``(x, row_max)``: ``float32 [B, V]`` (greedy rows penalized only, sampled rows
        also shifted and scaled) and ``float32 [B]``, the max of each row's penalized
        logits, NaN when the row holds one.
    """
    x = logits.float()
    if counts is not None:
        rep = fparams[:, REPETITION : REPETITION + 1]
        seen = counts > 0
        if prompt_mask is not None:
            seen = seen | prompt_mask
        x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
        freq = fparams[:, FREQUENCY : FREQUENCY + 1]
        presence = fparams[:, PRESENCE : PRESENCE + 1]
        x = x - (counts.to(torch.float32) * freq + (counts > 0).to(torch.float32) * presence)
    row_max = x.amax(dim=-1)  # NaN propagates
    temp = fparams[:, TEMPERATURE]
    sampled = (temp > 0).unsqueeze(1)
    scaled = (x - row_max.unsqueeze(1)) / torch.where(temp > 0, temp, 1.0).unsqueeze(1)
    return torch.where(sampled, scaled, x), row_max


def top_k_top_p(x: torch.Tensor, iparams: torch.Tensor, fparams: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over scaled logits: removed tokens become ``-inf``.

    Top-k keeps the tokens at or above the k-th value (ties kept); top-p keeps, in
    ascending order, the tokens whose cumulative mass (including themselves) exceeds
    ``1 - top_p``, and always the best token; the ascending sort is stable, so ties
    order by token id in every batch. Rows with neither filter come out unchanged.
    This is the one part the GPU path also runs in torch (a segmented sort is what it
    needs; torch's is a good one and launches no more than a Triton version would).

    Args:
        x: ``float32 [B, V]``, rows scaled by :func:`penalize_and_scale` (greedy rows
            must have top-k ``V`` and top-p floor ``-1``).
        iparams, fparams: the packed parameters.

    Returns:
        ``float32 [B, V]``, a new tensor.
    """
    V = x.shape[1]
    xs, order = torch.sort(x, dim=-1, stable=True)  # ascending
    k = iparams[:, TOP_K].clamp(1, V)
    kth = xs.gather(1, (V - k).unsqueeze(1))  # [B, 1]
    xs = xs.masked_fill(xs < kth, float("-inf"))
    cum = torch.softmax(xs, dim=-1).cumsum(dim=-1)
    drop = cum <= fparams[:, TOP_P_FLOOR : TOP_P_FLOOR + 1]
    drop[:, -1] = False  # the best token always stays
    xs = xs.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, xs)


def draw(
    x: torch.Tensor,
    row_max: torch.Tensor,
    fparams: torch.Tensor,
    iparams: torch.Tensor,
    filtered: torch.Tensor | None = None,
) -> torch.Tensor:
    """Min-p, then one token per row: argmax for greedy rows, the race for the others.

    Min-p keeps tokens with ``p >= min_p * p_max``.

    Args:
        x: ``float32 [B, V]`` from :func:`penalize_and_scale` (and :func:`top_k_top_p`).
        row_max: ``float32 [B]`` from :func:`penalize_and_scale`.
        fparams, iparams: the packed parameters (seed and step key the random draw).
        filtered: optional ``float32 [B, V]`` output: the sampled rows' logits after
            min-p (removed tokens ``-inf``), for tests of the support.

    Returns:
        ``int64 [B]``: token ids; :data:`INVALID_TOKEN` for rows whose ``row_max`` is not
        finite.
    """
    B, V = x.shape
    temp = fparams[:, TEMPERATURE]
    probs = torch.softmax(x, dim=-1)
    floor = fparams[:, MIN_P : MIN_P + 1] * probs.amax(dim=-1, keepdim=True)
    kept = x.masked_fill(probs < floor, float("-inf"))
    if filtered is not None:
        filtered.copy_(kept)
    probs = torch.softmax(kept, dim=-1)
    race = torch.empty_like(probs)
    for b in range(B):  # the reference's per-row generators; the kernel has none
        key = (int(iparams[b, SEED]) * _MIX + int(iparams[b, STEP])) & _MASK64
        race[b].exponential_(generator=torch.Generator(device=x.device).manual_seed(key))
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    sampled = (probs / race).argmax(dim=-1)
    tokens = torch.where(temp > 0, sampled, x.argmax(dim=-1))
    return torch.where(torch.isfinite(row_max), tokens, INVALID_TOKEN)
