"""Which tensor-parallel sizes split a model, and the shapes each rank holds (torch-free).

The service checks a size before its port opens and ``headroom plan`` prices one rank
from these; the ranks build their decoders from :func:`rank_model_config`
(:func:`engine.parallel.shard.rank_config`). The split follows Megatron-LM (Shoeybi et
al. 2019, section 3): heads, KV heads and MLP width divided by the world size, the
vocabulary in equal slices.
"""

from __future__ import annotations

import dataclasses

from engine.common.config import ModelConfig
from engine.common.errors import SettingRefused


def check_shardable(mc: ModelConfig, world: int) -> None:
    """Refuse a model ``world`` ranks cannot split.

    Raises:
        SettingRefused: the heads, KV heads or MLP width does not divide by ``world``, or
            the model has parts not split yet (MoE layers, a norm over the whole
            query/key projection, Gemma 4's layer kinds of their own heads); the message
            names the sizes that do split it.
    """
    if world == 1:
        return
    sizes = (("attention heads", mc.num_heads), ("KV heads", mc.num_kv_heads),
             ("MLP width (intermediate_size)", mc.intermediate_size))
    plural = {"attention heads", "KV heads"}
    problems = [f"its {n} {what} {'do' if what in plural else 'does'} not divide by {world}"
                for what, n in sizes if n % world]
    unsplittable = mc.is_moe or mc.qk_norm_whole or mc.gemma4 is not None
    if mc.is_moe:
        problems.append("mixture-of-experts layers are not split across ranks yet")
    if mc.qk_norm_whole:
        problems.append("its norm over the whole query/key projection spans every head")
    if mc.gemma4 is not None:
        problems.append("its layer kinds' own heads and shared KV layers are not split across ranks yet")
    if not problems:
        return
    divisors = [d for d in range(2, 9) if all(n % d == 0 for _, n in sizes)]
    if unsplittable or not divisors:
        fix = "use --tensor-parallel-size 1"
    else:
        fix = "use --tensor-parallel-size " + " or ".join(str(d) for d in divisors) + ", or 1"
    raise SettingRefused(f"--tensor-parallel-size {world} cannot split {mc.architecture}: "
                         + "; ".join(problems) + "; " + fix)


def vocab_slice(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows rank ``rank`` of ``world`` holds: equal
    slices of ``ceil(vocab_size / world)``, the last one shorter."""
    per = -(-vocab_size // world)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def rank_model_config(mc: ModelConfig, world: int, rank: int = 0) -> ModelConfig:
    """The shapes rank ``rank`` of ``world`` holds: heads, KV heads and MLP width divided
    by ``world``, the vocabulary cut to its slice (:func:`vocab_slice`).

    Raises:
        SettingRefused: see :func:`check_shardable`.
    """
    check_shardable(mc, world)
    if world == 1:
        return mc
    start, end = vocab_slice(mc.vocab_size, world, rank)
    return dataclasses.replace(
        mc,
        num_heads=mc.num_heads // world,
        num_kv_heads=mc.num_kv_heads // world,
        intermediate_size=mc.intermediate_size // world,
        vocab_size=end - start,
    )


def check_gpu_count(world: int, gpus: int) -> None:
    """Refuse more CUDA ranks than GPUs (``gpus``: CUDA's count, or NVML's where torch is
    not imported).

    Raises:
        SettingRefused: naming the size that fits (the count), or ``--device cpu``.
    """
    if gpus >= world:
        return
    fix = f"use --tensor-parallel-size {gpus}" if gpus > 1 else "use --tensor-parallel-size 1"
    raise SettingRefused(f"--tensor-parallel-size {world} needs {world} CUDA devices, this machine has {gpus}; "
                         f"{fix}, or --device cpu to run the ranks on the CPU")
