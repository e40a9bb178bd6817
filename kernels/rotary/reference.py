"""Rotary position embedding (Su et al., 2021), GPT-NeoX / transformers "rotate_half"
layout: the two halves of a head, not interleaved pairs, form the rotated pairs."""

from __future__ import annotations

import torch

from kernels.attention.kv_store import scatter_kv
from kernels.norm.reference import rms_norm


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their positions.

    With ``x = [x1 | x2]`` split in halves and ``cos``/``sin`` of the position's
    frequencies: ``out = [x1*cos - x2*sin | x2*cos + x1*sin]``, which is transformers'
    ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` term for term.

    Args:
        q: ``[T, Hq, D]``.
        k: ``[T, Hk, D]``, same dtype as ``q``.
        positions: ``[T]`` int64, absolute position of each token; each must be below
            ``max_pos``.
        cos_sin_cache: ``[max_pos, D]`` float32, ``cos`` of the ``D/2`` frequencies in the
            first half and ``sin`` in the second (see :mod:`engine.layers.rope`; Llama 3.1
            scaling is already folded into those frequencies).

    Returns:
        ``(q, k)`` rotated, in the input dtype and shapes: views of one new tensor
        (contiguous when ``T == 1``). ``cos``/``sin`` are cast to the input dtype before the
        multiplies, as transformers does.
    """
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
    cos2 = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, D]
    sin_pm = torch.cat((-sin, sin), dim=-1)[:, None, :]
    # q and k rotated as one tensor, and rotate_half as a roll ([x2 | x1]) times signed
    # sines: the same products and sums, rounded alike, in a third of the ops (on the
    # CPU a decode step is hundreds of small ops, each costing more than its arithmetic).
    qk = torch.cat((q, k), dim=1)
    out = qk * cos2 + qk.roll(qk.shape[-1] // 2, dims=-1) * sin_pm
    return out[:, : q.shape[1]], out[:, q.shape[1] :]


def rotary_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Per-head RMSNorm (Qwen3's q/k norm, optional), rotary, then the KV-cache store.

    The attention layer's whole path from the q/k/v projection to the paged pool in one
    call: the Triton version is one launch where this is five to seven.

    Args:
        q: ``[T, Hq, D]``, ``k``/``v``: ``[T, Hk, D]``, same dtype; views into the fused
            q/k/v projection are fine (last dimension contiguous). Not modified.
        positions: ``[T]`` int64, each below ``cos_sin_cache.shape[0]``.
        cos_sin_cache: ``[max_pos, D]`` float32, as in :func:`apply_rotary`.
        k_cache, v_cache: one layer's pool buffers, ``[num_slots, Hk, D]`` in ``k``'s
            dtype (see :mod:`engine.kvcache.pool`); rotated ``k`` and ``v`` are written
            at ``out_slots``.
        out_slots: ``[T]`` int64 flat slots, ``page * page_size + offset``, distinct.
        q_norm_weight, k_norm_weight: ``[D]`` RMSNorm weights applied to each head
            before rotary (both or neither); eps ``norm_eps``.

    Returns:
        Rotated ``q``, a new contiguous ``[T, Hq, D]`` tensor.
    """
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, norm_eps)
        k = rms_norm(k, k_norm_weight, norm_eps)
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    scatter_kv(k_cache, out_slots, k)
    scatter_kv(v_cache, out_slots, v)
    return q.contiguous()
