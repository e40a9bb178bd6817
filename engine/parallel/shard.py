"""Which part of the model each rank holds, decided at load time.

A rank builds the decoder from :func:`rank_config` (heads, KV heads, MLP width and
vocabulary divided) and fills it with :func:`shard_weights`' slices of the checkpoint's
tensors, so the decoder's own loading (the q/k/v and gate/up fusion) runs unchanged on
the smaller shapes. The split follows Megatron-LM (Shoeybi et al. 2019, section 3):
column-parallel q/k/v and gate/up (output rows), row-parallel o and down (input columns,
summed by an all-reduce), vocab-parallel embedding and LM head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.common.config import ModelConfig
from engine.parallel.group import TensorParallel
from engine.parallel.split import check_shardable as check_shardable  # where callers look for it
from engine.parallel.split import rank_model_config

# Checkpoint projections split by output rows / by input columns.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
# By their last two names, so a multimodal checkpoint's language model
# (``model.language_model.embed_tokens.weight``) splits as a text one does.
_VOCAB = ("embed_tokens", "lm_head")


def rank_config(mc: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes one rank's decoder has: heads, KV heads and MLP width divided by the
    world size, the vocabulary cut to this rank's slice (:meth:`TensorParallel.vocab_range`).

    Raises:
        engine.common.errors.SettingRefused: see :func:`engine.parallel.split.check_shardable`.
    """
    return rank_model_config(mc, tp.world, tp.rank)


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], mc: ModelConfig, tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's slice of each checkpoint tensor ``(name, tensor)`` (Hugging Face
    names, full shapes as :class:`ModelConfig` ``mc`` describes them).

    A row-parallel bias is added once, after the all-reduce: rank 0 keeps it, the others
    get zeros.
    """
    start, end = tp.vocab_range(mc.vocab_size)
    for name, tensor in weights:
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj in _VOCAB and parts[-1] == "weight":
            yield name, tensor[start:end]
        elif proj in _COLUMN:
            yield name, tensor.chunk(tp.world, dim=0)[tp.rank]
        elif proj in _ROW and parts[-1] == "weight":
            yield name, tensor.chunk(tp.world, dim=1)[tp.rank]
        elif proj in _ROW:  # the bias
            yield name, tensor if tp.is_leader else torch.zeros_like(tensor)
        else:
            yield name, tensor
