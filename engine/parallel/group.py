"""The process group of one tensor-parallel worker: setup and the collectives the model
uses.

The backend follows the device: NCCL on CUDA, gloo on the CPU. Rank ``r`` of a CUDA
group runs on ``cuda:r``. The ranks meet through a file store (a path rank 0 picks
under the temporary folder): no port to choose, none to collide with another service.

NCCL's NVLink multicast (NVLS) is switched off for the ranks (``NCCL_NVLS_ENABLE=0``):
it needs NVSwitch fabric support (the fabric manager, multicast-capable drivers) that
many hosts, and every pair of desktop cards, lack; NCCL then fails at communicator
creation instead of falling back. Plain ring/tree all-reduce over NVLink or PCIe is what
two or four cards of one machine use anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel.split import vocab_slice

# Environment every rank process gets before it touches NCCL (see the module docstring).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """The device string rank ``rank`` uses: ``cuda:rank`` for a CUDA group (``cuda``,
    ``auto`` on a GPU machine, ``cuda:N`` alike), ``cpu`` stays ``cpu``."""
    if device == "cpu":
        return "cpu"
    if device == "auto" and not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{rank}"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: 0 .. ``world - 1``; rank 0 runs the scheduler.
        world: the number of ranks (``--tensor-parallel-size``).
        device: this rank's device; the collectives' tensors live there.
    """

    rank: int
    world: int
    device: torch.device

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- collectives the model uses -------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x`` (a row-parallel linear's
        partial products become the full product)."""
        dist.all_reduce(x)
        return x

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """``[start, end)`` of the vocabulary rows this rank holds: equal slices of
        ``ceil(vocab_size / world)``, the last one shorter."""
        return vocab_slice(vocab_size, self.world, self.rank)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Vocab-parallel embedding: ``[T]`` ids -> ``[T, hidden]``; each rank looks up
        the ids of its slice (zeros elsewhere), the all-reduce sums the slices."""
        start, end = self.vocab_range(vocab_size)
        mine = (ids >= start) & (ids < end)
        h = torch.nn.functional.embedding((ids - start).clamp(0, end - start - 1), weight)
        h = h * mine.unsqueeze(-1).to(h.dtype)
        return self.all_reduce(h)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[S, local vocab]`` -> ``[S, vocab_size]`` on every rank (all-gather of
        equal, padded slices, then the padding cut)."""
        per = -(-vocab_size // self.world)
        if logits.shape[1] < per:
            logits = torch.nn.functional.pad(logits, (0, per - logits.shape[1]))
        if self.device.type == "cuda":
            # One stacked output, no copies after the collective: what a CUDA graph
            # captures cleanly (the list form copies into its parts afterwards).
            stacked = torch.empty((self.world, *logits.shape), dtype=logits.dtype, device=logits.device)
            dist.all_gather_into_tensor(stacked, logits.contiguous())
            return stacked.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, :vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_int(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return [int(p.item()) for p in parts]


def init_group(rank: int, world: int, device: torch.device, store_path: str) -> TensorParallel:
    """Join the group (blocks until all ``world`` ranks joined) and return this rank's
    :class:`TensorParallel`.

    Raises:
        RuntimeError: from ``torch.distributed`` when the group cannot form.
    """
    os.environ.update(NCCL_ENV)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method=f"file://{store_path}", rank=rank, world_size=world,
        device_id=device if device.type == "cuda" else None,
    )
    return TensorParallel(rank=rank, world=world, device=device)


def leave_group() -> None:
    """Destroy the process group if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
