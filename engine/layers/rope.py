"""The cos/sin cache of rotary position embeddings, from a :class:`RopeConfig`.

Frequencies are computed with the same float32 operations, in the same order, as
transformers' ``modeling_rope_utils`` (``compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``), so our
cos/sin equal theirs bit for bit and logits match.
"""

from __future__ import annotations

import math

import torch

from engine.common.config import SUPPORTED_ROPE_TYPES, RopeConfig
from engine.common.load_errors import UnsupportedConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i / head_dim)``, scaled by the RoPE type.

    Returns:
        ``[head_dim // 2]`` float32 on the CPU.

    Raises:
        UnsupportedConfig: ``rope.rope_type`` is not one of :data:`SUPPORTED_ROPE_TYPES`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    freqs = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return freqs
    if rope.rope_type == "linear":
        return freqs / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(freqs, rope)
    raise UnsupportedConfig(
        f"RoPE type {rope.rope_type!r} is not supported; headroom implements "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_scale(freqs: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling.

    Source: Meta's reference ``apply_scaling`` in ``llama/model.py`` of
    meta-llama/llama-models (Llama 3.1), as transcribed by transformers'
    ``_compute_llama3_parameters``: wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` keep their frequency, longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, and those in between are interpolated smoothly.
    """
    factor = rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high

    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    rope: RopeConfig,
    head_dim: int,
    max_positions: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """cos and sin of ``position * inv_freq`` for every position below ``max_positions``.

    Returns:
        ``[max_positions, head_dim]`` float32: cos of the ``head_dim // 2`` frequencies in
        the first half, sin in the second (the layout :func:`kernels.rotary.reference.apply_rotary`
        reads). ``max_positions * head_dim * 4`` bytes.

    Raises:
        UnsupportedConfig: unknown RoPE type.
    """
    freqs = inv_freq(rope, head_dim).to(device)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).to(torch.float32)
    angles = positions[:, None] * freqs[None, :]  # [max_positions, head_dim // 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
