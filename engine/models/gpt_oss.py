"""gpt-oss (``GptOssForCausalLM``), as transformers' ``modeling_gpt_oss`` computes it.

Its layers are the decoder's (:mod:`engine.models.decoder`) with what its config records
(:func:`engine.loader.hf_config._gpt_oss_fields`):

- q/k/v and o with biases; a learned sink logit per head joining each softmax's
  denominator (:attr:`~engine.models.decoder.Attention.sinks`, the attention backend's
  ``sinks``);
- ``"sliding_attention"`` layers over the last ``sliding_window`` tokens alternating with
  ``"full_attention"`` ones (the backend's windows, :attr:`ModelConfig.kv_windows`), all
  rotating with one YaRN-scaled RoPE (:mod:`engine.layers.rope`);
- a mixture of experts in every layer: a router with a bias whose top-k logits are
  softmaxed alone, experts with biases and the clamped SwiGLU
  (:class:`~engine.layers.moe.sparse_moe.SparseMoeBlock`).

What differs is the checkpoint: the router is ``mlp.router``; the experts are stacked
transposed, ``gate_up_proj`` ``[E, H, 2I]`` with gate and up columns interleaved (gate
the even ones) and ``down_proj`` ``[E, I, H]``. :meth:`GptOssCausalLM.load_weights` turns
them into the stacked layout of :class:`~engine.layers.moe.sparse_moe.Experts`
(``[E, 2I, H]`` gate rows first, ``[E, H, I]``). Experts in MXFP4 blocks, as OpenAI
publishes them (``gate_up_proj_blocks`` ``[E, 2I, H / 32, 16]`` uint8, two 4-bit E2M1
values a byte, low nibble first, with ``gate_up_proj_scales`` ``[E, 2I, H / 32]``, one
power of two a block of 32, biased by 127; ``down_proj_*`` the same over ``[E, H, I]``),
are dequantized at load into the model dtype (:func:`mxfp4_to_dense`; exact: every
MXFP4 value is a bfloat16 one), so they take the dense experts' memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from engine.common.load_errors import UnsupportedConfig
from engine.models.decoder import CausalLM

log = logging.getLogger("headroom.engine")

_MXFP4_SUFFIXES = ("_blocks", "_scales")

# The 16 values of a 4-bit E2M1 code (sign bit highest): OCP's microscaling formats spec.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_dense(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 rows to ``dtype``: ``blocks`` ``[E, R, G, 16]`` uint8 (two codes a byte, the
    low nibble the even element), ``scales`` ``[E, R, G]`` uint8 (``2 ** (s - 127)`` for
    each block of 32) -> ``[E, R, G * 32]``, one expert at a time (the transient is one
    expert's codes).

    Raises:
        ValueError: the shapes do not pair.
    """
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair")
    lut = torch.tensor(_E2M1, dtype=dtype)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype)
    for e in range(blocks.shape[0]):
        codes = blocks[e]
        values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)  # [R, G, 32]
        exponents = scales[e].to(torch.int32)[..., None] - 127
        out[e] = torch.ldexp(values, exponents).flatten(-2).to(dtype)
    return out


def _dequantized(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each pair of MXFP4 ``*_blocks``/``*_scales`` tensors replaced by
    the dense tensor under the checkpoint's bfloat16 name and layout (``gate_up_proj``
    ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``: views, transposed)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    logged = False
    for name, tensor in weights:
        suffix = next((s for s in _MXFP4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == 2:
            del pending[base]
            if not logged:
                log.info("gpt-oss: the experts' MXFP4 blocks are dequantized to %s at load "
                         "(they take the dense experts' memory)", str(dtype).removeprefix("torch."))
                logged = True
            yield base, mxfp4_to_dense(parts["_blocks"], parts["_scales"], dtype).transpose(1, 2)
    if pending:
        raise UnsupportedConfig(f"MXFP4 tensors without their pair: {', '.join(sorted(pending))}")


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` with gate and up interleaved (gate at even indices) -> gate half first."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


def hf_to_ours(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One gpt-oss checkpoint tensor (bfloat16 layout) under the name and layout of our
    parameter."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] gate rows first
        return name, _deinterleave(tensor).transpose(1, 2)
    if name.endswith(".mlp.experts.gate_up_proj_bias"):
        return name, _deinterleave(tensor)
    if name.endswith(".mlp.experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return name, tensor.transpose(1, 2)
    return name, tensor


class GptOssCausalLM(CausalLM):
    """gpt-oss over the paged KV cache; :class:`CausalLM`'s life cycle and forward. No
    tensor parallelism yet (the sinks are per head and not split), and the C decode layer
    declines it (:meth:`engine.layers.cpu_decode.CpuDecode.build`)."""

    def use_parallel(self, tp, full_vocab_size: int) -> None:
        raise ValueError("gpt-oss does not run tensor-parallel yet; use --tensor-parallel-size 1")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`CausalLM.load_weights` of a gpt-oss checkpoint: MXFP4 experts
        dequantized, the router renamed, the experts transposed and de-interleaved
        (:func:`hf_to_ours`).

        Raises:
            UnsupportedConfig: an MXFP4 tensor without its pair.
            WeightMismatch: as :meth:`CausalLM.load_weights`.
        """
        dtype = self.model.norm.weight.dtype

        def ours() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _dequantized(weights, dtype):
                yield hf_to_ours(name, tensor)

        super().load_weights(ours())
