"""The attention backend interface and its registry.

A backend reads and writes the paged KV pool. The model calls
:meth:`AttentionBackend.forward` once per layer; :meth:`prepare` runs once per step, so
per-step metadata (gathered slot indices, masks) is built once and shared by all layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool


class AttentionBackend(ABC):
    """Paged attention over a :class:`KVPool`.

    Attributes:
        workspace_bytes: fixed device memory the backend allocates for itself, in bytes;
            declared so the memory plan can charge it before the KV pool is sized.
    """

    workspace_bytes: int = 0

    def __init__(self, pool: KVPool, *, num_heads: int, head_dim: int, scale: float) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata for ``batch``; called once before the layers run."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store the new keys/values and attend.

        Args:
            q: ``[T, num_heads, head_dim]``.
            k, v: ``[T, num_kv_heads, head_dim]``, written to ``batch.out_slots``.
            layer: layer index into the pool.
            kv_stored: the caller already wrote ``k``/``v`` (rotated) into the pool at
                ``batch.out_slots`` (the model's fused rotary + store kernel); the
                backend then skips its store and reads them from the pool.

        Returns:
            ``[T, num_heads * head_dim]`` in ``q``'s dtype: causal attention of each new
            token over its sequence's cached prefix and the new tokens up to itself.
        """


_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls

    return deco


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered under ``name`` (its ``workspace_bytes`` is what the plan
    charges before anything is allocated).

    Raises:
        ValueError: no backend of that name; the message lists the known ones.
    """
    import engine.attention.torch_backend  # noqa: F401  (registers the built-in backends)

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]


def create_attention_backend(name: str, pool: KVPool, **kwargs) -> AttentionBackend:
    """Build the backend registered under ``name``.

    Raises:
        ValueError: no backend of that name; the message lists the known ones.
    """
    return backend_class(name)(pool, **kwargs)
