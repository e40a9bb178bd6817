"""The cos/sin cache of rotary position embeddings, from a :class:`RopeConfig`.

Frequencies are computed with the same float32 operations, in the same order, as
transformers' ``modeling_rope_utils`` (``compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``,
``_compute_yarn_parameters``), so our cos/sin equal theirs bit for bit and logits match.
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
    if rope.rope_type == "yarn":
        return _yarn_freqs(rope, head_dim)
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


def _yarn_freqs(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, "YaRN: Efficient Context Window Extension"):
    dimensions that turn more than ``beta_fast`` times over the original context keep
    their frequency, those that turn fewer than ``beta_slow`` times are divided by
    ``factor``, with a linear ramp between the two bounds (in dimensions, rounded outward
    when ``truncate``)."""
    base, factor, original = rope.theta, rope.factor, rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(rope: RopeConfig) -> float:
    """The factor on cos and sin: YaRN's ``attention_factor`` (``0.1 * ln(factor) + 1``
    when the config leaves it 0 and ``factor`` > 1), else 1."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor:
        return rope.attention_factor
    return 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0


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
    scale = attention_factor(rope)
    if scale != 1.0:  # YaRN
        return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
