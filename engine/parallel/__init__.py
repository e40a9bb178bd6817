"""Tensor parallelism across the GPUs of one machine, on ``torch.distributed``.

A worker started with ``--tensor-parallel-size N`` is a group of N rank processes
(:mod:`engine.parallel.group`). Rank 0 is the worker the service talks to: it runs the
scheduler and the sampler; every other rank follows its schedule
(:mod:`engine.parallel.follow`): rank 0 broadcasts each step's inputs and each change of
the KV pool, and all ranks run the same forward on their shard of the weights
(:mod:`engine.parallel.shard`): q/k/v and gate/up split by output rows
(column-parallel), o/down by input columns (row-parallel, then an all-reduce), the
embedding and the LM head by vocabulary rows, the KV heads across ranks (each rank's KV
pool holds its heads; every rank's page table is the same).

The collectives run on NCCL on CUDA and on gloo on the CPU: the same code either way.
"""

from engine.parallel.group import TensorParallel

__all__ = ["TensorParallel"]
