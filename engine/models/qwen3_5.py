"""Qwen3.5 / Qwen3.6, dense and MoE: Qwen3-Next's hybrid (:mod:`engine.models.qwen3_next`)
as transformers' ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` compute it, and the
language model of the vision-language checkpoints Qwen publishes
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``).

What differs from Qwen3-Next, and where headroom takes it:

- The Gated DeltaNet's projections are flat, not grouped per key head: ``in_proj_qkv``
  (``[q | k | v]``, the conv's input as is), ``in_proj_z`` (the output gate), ``in_proj_b``
  and ``in_proj_a`` (``Hv`` each). They are fused here into Qwen3-Next's two parameters
  (``in_proj_qkvz = [qkv | z]``, ``in_proj_ba = [b | a]``) and split flat
  (:class:`FlatGatedDeltaNet`); the recurrence, conv, norms and state pool are the same.
- RoPE is the vision models' multimodal RoPE (``mrope_section``); for text every token's
  three position axes are equal, which is plain RoPE over the first
  ``head_dim * partial_rotary_factor`` dims of a head, as Qwen3-Next's.
- The MoE model routes in every layer (no dense MLP, no ``intermediate_size``), its router
  always renormalizes the top-k weights, and a shared expert sits behind a sigmoid gate.
- The published checkpoints nest the text model's config in ``text_config`` and its
  weights under ``model.language_model.``; the vision tower (``model.visual.``) and the
  multi-token-prediction head (``mtp.``) are not loaded (logged once at load).

Gated full attention, zero-centred RMSNorms (``1 + w``) and the shared expert's gate are
Qwen3-Next's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from engine.layers.gated_deltanet import GatedDeltaNet
from engine.models.hf_weights import Shard
from engine.models.qwen3_next import HybridCausalLM

log = logging.getLogger("headroom.engine")

# The published vision-language checkpoints' prefix of the language model's tensors.
_LANGUAGE_MODEL = "model.language_model."

# Tensors of those checkpoints a text model has no place for: what each is, for the log.
_NOT_LOADED = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction head"}

# A linear layer's Hugging Face projections -> (our fused parameter, shard).
_FLAT_PROJ = {
    "in_proj_qkv": ("in_proj_qkvz", "qkv"),
    "in_proj_z": ("in_proj_qkvz", "z"),
    "in_proj_b": ("in_proj_ba", "b"),
    "in_proj_a": ("in_proj_ba", "a"),
}


class FlatGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: :class:`GatedDeltaNet` with flat projections,
    ``in_proj_qkvz`` ``[q | k | v | z]`` and ``in_proj_ba`` ``[b | a]``, heads in order."""

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.hv, self.hv], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b, a


class Qwen35CausalLM(HybridCausalLM):
    """Qwen3.5 / Qwen3.6 (dense or MoE, as the config's ``moe_layers`` say) over the paged
    KV cache and the state pool; :class:`HybridCausalLM` with :class:`FlatGatedDeltaNet`
    layers and the checkpoints' names."""

    linear_attention = FlatGatedDeltaNet

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`HybridCausalLM.load_weights` of the language model's tensors: those under
        ``model.language_model.`` as ``model.``; the vision tower's and the
        multi-token-prediction head's left out, and said so in the log.

        Raises:
            WeightMismatch: as :meth:`HybridCausalLM.load_weights`.
        """
        skipped: dict[str, int] = {}
        super().load_weights(_language_model(weights, skipped))
        for prefix, count in skipped.items():
            log.info("%s: %s not loaded (%d tensors under %s); headroom runs the language model",
                     self.config.architecture, _NOT_LOADED[prefix], count, prefix)

    def _target(self, hf_name: str) -> tuple[str, Shard]:
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in _FLAT_PROJ:
            fused, shard = _FLAT_PROJ[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return super()._target(hf_name)

    def _shards(self, name: str, param: torch.Tensor) -> list[Shard]:
        if name.endswith(".in_proj_qkvz.weight"):
            return ["qkv", "z"]
        if name.endswith(".in_proj_ba.weight"):
            return ["b", "a"]
        return super()._shards(name, param)

    def _shard_view(self, param: torch.Tensor, shard: Shard) -> torch.Tensor:
        cfg = self.config
        hv = cfg.linear_num_value_heads
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim
        flat = {"qkv": (0, conv_dim), "z": (conv_dim, param.shape[0] - conv_dim), "b": (0, hv), "a": (hv, hv)}
        if isinstance(shard, str) and shard in flat:
            return param.narrow(0, *flat[shard])
        return super()._shard_view(param, shard)


def _language_model(
    weights: Iterable[tuple[str, torch.Tensor]], skipped: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with ``model.language_model.`` read as ``model.`` and the tensors of
    :data:`_NOT_LOADED` left out (counted per prefix into ``skipped``)."""
    for name, tensor in weights:
        prefix = next((p for p in _NOT_LOADED if name.startswith(p)), None)
        if prefix is not None:
            skipped[prefix] = skipped.get(prefix, 0) + 1
            continue
        if name.startswith(_LANGUAGE_MODEL):
            name = "model." + name[len(_LANGUAGE_MODEL):]
        yield name, tensor
