"""GGUF blocks rearranged for the GPU kernels: the same bytes, aligned for wide loads.

A Q6_K block is 210 bytes (ggml-common.h ``block_q6_K``: 128 bytes of low nibbles
``ql``, 64 bytes of 2-bit highs ``qh``, 16 int8 sub-block scales, a float16 ``d``), so
in a row of blocks only every eighth block starts on a 16-byte boundary and a kernel
reading a block's words can only load 16 bits at a time. ``Q6_K_P`` keeps each row's
bytes but groups them by field, as four planes::

    row = [ ql of blocks 0..NB-1 | qh of blocks 0..NB-1 | scales ... | d ... ]
            NB * 128 bytes         NB * 64                NB * 16      NB * 2

so block ``kb``'s ``ql`` starts at ``128 kb``, its ``qh`` at ``128 NB + 64 kb``, its
scales at ``192 NB + 16 kb`` and its ``d`` at ``208 NB + 2 kb``: every field of every
block is as aligned as the row. Within a field the bytes keep ggml's order, so the
kernels decode a plane's bytes as they decode the block's.

A row is ``210 NB`` bytes either way, so the memory plan's price
(:func:`kernels.quant.formats.tensor_bytes`) is unchanged. Rows whose ``NB`` is odd
(``210 NB`` not a multiple of 4) are left as GGUF blocks (:func:`repackable`): their
planes could not be read as 32-bit words.
"""

from __future__ import annotations

import torch

from kernels.quant.formats import REPACKED_FROM

# Q6_K's fields: (offset in the block, bytes), in block order.
_Q6K_FIELDS = ((0, 128), (128, 64), (192, 16), (208, 2))
_Q6K_BYTES = 210
# Rows repacked at a time: the temporary stays small next to a 128k-row LM head.
_CHUNK_ROWS = 4096


def repacked_type(type_name: str) -> str | None:
    """The layout ``type_name``'s blocks are repacked into on CUDA, or None."""
    for layout, source in REPACKED_FROM.items():
        if source == type_name:
            return layout
    return None


def repackable(type_name: str, blocks: torch.Tensor) -> bool:
    """Whether ``blocks`` (uint8 ``[N, row_bytes]`` of ``type_name``) can take
    :func:`repacked_type`'s layout: rows of an even number of Q6_K blocks."""
    if repacked_type(type_name) is None or blocks.dim() != 2 or blocks.shape[1] % _Q6K_BYTES:
        return False
    return (blocks.shape[1] // _Q6K_BYTES) % 2 == 0


def q6k_to_planes(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Q6_K blocks to the ``Q6_K_P`` layout (module docstring).

    Args:
        blocks: uint8 ``[N, NB * 210]``, GGUF Q6_K blocks row by row (any device).
        out: where to write (uint8, ``blocks``' shape); may be ``blocks`` itself, which is
            then repacked in place, a chunk of rows at a time.

    Returns:
        uint8 ``[N, NB * 210]``: ``out`` when given.

    Raises:
        ValueError: ``blocks`` is not 2-D uint8 with whole blocks per row.
    """
    return _regroup(blocks, out, to_planes=True)


def planes_to_q6k(planes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`q6k_to_planes` (same arguments, ``planes`` in ``Q6_K_P``)."""
    return _regroup(planes, out, to_planes=False)


def _regroup(src: torch.Tensor, out: torch.Tensor | None, *, to_planes: bool) -> torch.Tensor:
    if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[1] % _Q6K_BYTES:
        raise ValueError(f"want uint8 [N, NB * {_Q6K_BYTES}] Q6_K rows, got {src.dtype} {tuple(src.shape)}")
    if out is None:
        out = torch.empty_like(src)
    elif out.shape != src.shape or out.dtype != torch.uint8:
        raise ValueError(f"out must be uint8 {tuple(src.shape)}, got {out.dtype} {tuple(out.shape)}")
    n, nb = src.shape[0], src.shape[1] // _Q6K_BYTES
    for r0 in range(0, n, _CHUNK_ROWS):
        rows = src[r0 : r0 + _CHUNK_ROWS]
        if to_planes:
            blocks = rows.reshape(rows.shape[0], nb, _Q6K_BYTES)
            moved = torch.cat([blocks[:, :, o : o + size].reshape(rows.shape[0], nb * size)
                               for o, size in _Q6K_FIELDS], dim=1)
        else:
            fields, start = [], 0
            for _, size in _Q6K_FIELDS:
                fields.append(rows[:, start : start + nb * size].reshape(rows.shape[0], nb, size))
                start += nb * size
            moved = torch.cat(fields, dim=2).reshape(rows.shape[0], nb * _Q6K_BYTES)
        out[r0 : r0 + _CHUNK_ROWS].copy_(moved)  # ``moved`` is a new tensor: safe in place
    return out


def to_layout(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """GGUF blocks of :data:`kernels.quant.formats.REPACKED_FROM` ``[layout]`` in
    ``layout`` (a new tensor).

    Raises:
        ValueError: an unknown layout, or blocks that do not fit it.
    """
    if layout != "Q6_K_P":
        raise ValueError(f"no repacked layout {layout}; known: {', '.join(REPACKED_FROM)}")
    return q6k_to_planes(blocks)


def to_gguf_blocks(blocks: torch.Tensor, type_name: str) -> tuple[torch.Tensor, str]:
    """``(blocks, type)`` as GGUF stores them: a repacked layout turned back (for the
    reference dequantizer), anything else as given."""
    if type_name == "Q6_K_P":
        return planes_to_q6k(blocks), "Q6_K"
    return blocks, type_name
