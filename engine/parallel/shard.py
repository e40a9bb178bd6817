"""Which part of the model each rank holds, decided at load time.

A rank builds the decoder from :func:`rank_config` (heads, KV heads, MLP width and
vocabulary divided) and fills it with :func:`shard_weights`' slices of the checkpoint's
tensors, so the decoder's own loading (the q/k/v and gate/up fusion) runs unchanged on
the smaller shapes. The split follows Megatron-LM (Shoeybi et al. 2019, section 3):
column-parallel q/k/v and gate/up (output rows), row-parallel o and down (input columns,
summed by an all-reduce), vocab-parallel embedding and LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from engine.config import ModelConfig
from engine.parallel.group import TensorParallel

# Checkpoint projections split by output rows / by input columns.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_shardable(mc: ModelConfig, world: int) -> None:
    """Raise ``ValueError`` (naming the fix) when ``mc`` cannot be split ``world`` ways."""
    sizes = (("attention heads", mc.num_heads), ("KV heads", mc.num_kv_heads),
             ("MLP width (intermediate_size)", mc.intermediate_size))
    problems = [f"its {n} {what} do not divide by {world}" for what, n in sizes if n % world]
    unsplittable = mc.is_moe or mc.qk_norm_whole
    if mc.is_moe:
        problems.append("mixture-of-experts layers are not split across ranks yet")
    if mc.qk_norm_whole:
        problems.append("its norm over the whole query/key projection spans every head")
    if not problems:
        return
    divisors = [d for d in range(2, 9) if all(n % d == 0 for _, n in sizes)]
    if unsplittable or not divisors:
        fix = "use --tensor-parallel-size 1"
    else:
        fix = "use --tensor-parallel-size " + " or ".join(str(d) for d in divisors) + ", or 1"
    raise ValueError(f"--tensor-parallel-size {world} cannot split {mc.architecture}: " + "; ".join(problems)
                     + "; " + fix)


def rank_config(mc: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes one rank's decoder has: heads, KV heads and MLP width divided by the
    world size, the vocabulary cut to this rank's slice (:meth:`TensorParallel.vocab_range`).

    Raises:
        ValueError: see :func:`check_shardable`.
    """
    check_shardable(mc, tp.world)
    start, end = tp.vocab_range(mc.vocab_size)
    return dataclasses.replace(
        mc,
        num_heads=mc.num_heads // tp.world,
        num_kv_heads=mc.num_kv_heads // tp.world,
        intermediate_size=mc.intermediate_size // tp.world,
        vocab_size=end - start,
    )


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
        if name in _VOCAB:
            yield name, tensor[start:end]
        elif proj in _COLUMN:
            yield name, tensor.chunk(tp.world, dim=0)[tp.rank]
        elif proj in _ROW and parts[-1] == "weight":
            yield name, tensor.chunk(tp.world, dim=1)[tp.rank]
        elif proj in _ROW:  # the bias
            yield name, tensor if tp.is_leader else torch.zeros_like(tensor)
        else:
            yield name, tensor
