"""Tensor parallelism across the GPUs of one machine, on ``torch.distributed``.

A worker started with ``--tensor-parallel-size N`` is a group of N rank processes
(:mod:`engine.parallel.group`). Rank 0 is the worker the service talks to: it runs the
scheduler and the sampler; every other rank follows its schedule
(:mod:`engine.core.tp_follow`): rank 0 broadcasts each step's inputs and each change of
the KV pool, and all ranks run the same forward on their shard of the weights
(:mod:`engine.parallel.shard`): q/k/v and gate/up split by output rows
(column-parallel), o/down by input columns (row-parallel, then an all-reduce), the
embedding and the LM head by vocabulary rows, the KV heads across ranks (each rank's KV
pool holds its heads; every rank's page table is the same).

On GPUs each rank replays its own decode CUDA graphs, the collectives captured inside,
fed by one device-to-device broadcast of rank 0's packed inputs per step
(:mod:`engine.core.tp_graphs`).

The collectives run on NCCL on CUDA and on gloo on the CPU: the same code either way.
Which sizes split a model, and each rank's shapes, are torch-free
(:mod:`engine.parallel.split`), so the service and ``headroom plan`` check and price them
before any rank starts; this package imports torch only when its other modules are used.
"""

from typing import Any

__all__ = ["TensorParallel"]


def __getattr__(name: str) -> Any:
    if name == "TensorParallel":
        from engine.parallel.group import TensorParallel

        return TensorParallel
    raise AttributeError(name)
