"""Paged attention over the KV pool: plain-torch references.

The pool keeps one key and one value buffer per layer, ``[num_slots, num_kv_heads,
head_dim]``; token ``p`` of a sequence lives at slot ``page_table[b, p // page_size] *
page_size + p % page_size``. These references loop over sequences and gather each one's
context: slow, exact, runnable anywhere. :mod:`kernels.attention.triton_kernel` implements the
same signatures as Triton kernels and is tested against them.

Grouped-query attention: query head ``h`` reads key/value head ``h // (H / H_kv)``
(the layout of transformers' ``repeat_kv``).
"""

from __future__ import annotations

import torch

from kernels.attention.kv_store import gather_kv


def context_slots(page_table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """``[length]`` int64: the slots of positions ``0 .. length-1`` of one sequence."""
    pos = torch.arange(length, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
            window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [E, H, D]`` over ``k, v [S, H_kv, D]``; query ``i`` sees keys ``j <= q_pos[i]``
    (and ``j > q_pos[i] - window`` when ``window`` is not 0). Scores capped at
    ``softcap * tanh(s / softcap)`` before the mask (0: none); ``sinks`` (``[H]`` logits)
    each a last softmax column of its head, dropped before the values. Computed in
    float32; returns ``[E, H, D]`` in ``q``'s dtype."""
    groups = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)  # [S, H, D]
    vf = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("ehd,shd->hes", q.float(), kf) * scale  # [H, E, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = j <= q_pos[:, None]  # [E, S]
    if window:
        visible &= j > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("hes,shd->ehd", probs, vf)
    return out.to(q.dtype)


def paged_decode_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence attends over its whole context (itself included), or
    over its last ``window`` tokens when ``window`` is not 0 (a sliding-window layer).

    Args:
        q: ``[B, H, D]``, the new tokens' queries.
        k_buf, v_buf: ``[num_slots, H_kv, D]``, one layer of the pool; the new tokens'
            keys and values are already stored.
        page_table: ``[B, max_pages]`` int32/int64 page ids.
        seq_lens: ``[B]`` int, context length of each sequence including the new token;
            a row of length 0 (CUDA-graph padding) gives zeros.
        page_size: tokens per page.
        scale: softmax scale, usually ``D ** -0.5``.
        softcap: scores capped at ``softcap * tanh(s / softcap)`` before the mask (Gemma's
            ``attn_logit_softcapping``; 0: none).
        sinks: ``[H]`` logits, each a softmax column of its head with no value (gpt-oss's
            attention sinks); None: none.

    Returns:
        ``[B, H, D]`` in ``q``'s dtype.
    """
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        slots = context_slots(page_table[b], n, page_size)
        q_pos = torch.tensor([n - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], gather_kv(k_buf, slots, q.dtype), gather_kv(v_buf, slots, q.dtype), q_pos, scale,
                         window, softcap, sinks)[0]
    return out


def paged_extend_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged prefill/extend: sequence ``b`` adds ``extend_lens[b]`` tokens after a cached
    prefix of ``prefix_lens[b]``; new token ``i`` sees context positions
    ``j <= prefix_lens[b] + i`` (causal, prefix included), and only
    ``j > prefix_lens[b] + i - window`` when ``window`` is not 0.

    Args:
        q: ``[T, H, D]``, the new tokens of all sequences, concatenated; sequence ``b``
            owns rows ``q_starts[b] .. q_starts[b] + extend_lens[b] - 1``.
        k_buf, v_buf: ``[num_slots, H_kv, D]``; the new tokens' keys and values are
            already stored.
        page_table: ``[B, max_pages]`` page ids.
        q_starts, prefix_lens, extend_lens: ``[B]`` int.
        page_size, scale, softcap, sinks: as in :func:`paged_decode_ref`.

    Returns:
        ``[T, H, D]`` in ``q``'s dtype.
    """
    out = torch.zeros_like(q)
    for b, (start, prefix, ext) in enumerate(zip(q_starts.tolist(), prefix_lens.tolist(), extend_lens.tolist(), strict=True)):
        if ext == 0:
            continue
        slots = context_slots(page_table[b], prefix + ext, page_size)
        q_pos = prefix + torch.arange(ext, device=q.device)
        out[start : start + ext] = _attend(q[start : start + ext], gather_kv(k_buf, slots, q.dtype),
                                           gather_kv(v_buf, slots, q.dtype), q_pos, scale, window, softcap, sinks)
    return out
