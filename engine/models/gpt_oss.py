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
(``[E, 2I, H]`` gate rows first, ``[E, H, I]``). Experts quantized to MXFP4
(``*_blocks``/``*_scales``, as OpenAI publishes them) are refused with the way out: the
checkpoint dequantized to bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.common.load_errors import UnsupportedConfig
from engine.models.decoder import CausalLM

_MXFP4_SUFFIXES = ("_blocks", "_scales")


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` with gate and up interleaved (gate at even indices) -> gate half first."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


def hf_to_ours(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One gpt-oss checkpoint tensor under the name and layout of our parameter.

    Raises:
        UnsupportedConfig: the experts are in MXFP4 blocks.
    """
    if name.endswith(_MXFP4_SUFFIXES):
        raise UnsupportedConfig(
            f"tensor {name}: experts in MXFP4 blocks are not supported yet; use a bfloat16 copy of the "
            "checkpoint (transformers: from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)), "
            "then save_pretrained)")
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
        """:meth:`CausalLM.load_weights` of a gpt-oss checkpoint: the router renamed, the
        experts transposed and de-interleaved (:func:`hf_to_ours`).

        Raises:
            UnsupportedConfig: the experts are in MXFP4 blocks.
            WeightMismatch: as :meth:`CausalLM.load_weights`.
        """

        def ours() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield hf_to_ours(name, tensor)

        super().load_weights(ours())
