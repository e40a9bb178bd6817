"""Rotary position embedding (Su et al., 2021), GPT-NeoX / transformers "rotate_half"
layout: the two halves of a head, not interleaved pairs, form the rotated pairs."""

from __future__ import annotations

import torch


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
            first half and ``sin`` in the second (see :mod:`engine.models.rope`).

    Returns:
        ``(q, k)`` rotated, new tensors in the input dtype and shapes. ``cos``/``sin`` are
        cast to the input dtype before the multiplies, as transformers does.
    """
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
