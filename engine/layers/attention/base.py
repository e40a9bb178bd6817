"""The attention backend interface and its registry.

A backend reads and writes the paged KV pool. The model calls
:meth:`AttentionBackend.forward` once per layer; :meth:`prepare` runs once per step, so
per-step metadata (gathered slot indices, masks) is built once and shared by all layers.

Built-in backends: ``torch`` (plain torch, any device; the reference), ``triton``
(Triton kernels on CUDA), ``flashinfer`` (FlashInfer's paged wrappers, when the
package imports). ``auto`` (:func:`resolve_backend_name`) picks one for the device.
"""

from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from engine.common.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool

log = logging.getLogger("headroom.engine")

BACKEND_CHOICES: tuple[str, ...] = ("auto", "triton", "flashinfer", "torch")


class AttentionBackend(ABC):
    """Paged attention over a :class:`KVPool`.

    Attributes:
        workspace_bytes: fixed device memory the backend allocates for itself, in bytes,
            when it does not depend on the model (else see :meth:`workspace_size`).
        supports_cuda_graphs: :meth:`prepare` and :meth:`forward` of a decode batch whose
            device tensors the runner filled issue no host sync and no host-to-device
            copy while a CUDA graph is being captured, so a decode step can be captured
            and replayed; host work the kernels need per step goes in :meth:`graph_plan`.
    """

    workspace_bytes: int = 0
    supports_cuda_graphs: bool = False

    def __init__(self, pool: KVPool, *, num_heads: int, head_dim: int, scale: float, max_batch: int = 64) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.max_batch = max_batch

    @classmethod
    def workspace_size(cls, *, num_heads: int, num_kv_heads: int, head_dim: int, max_batch: int) -> int:
        """Fixed device memory, in bytes, the backend allocates for a model of these
        shapes serving up to ``max_batch`` sequences per step; declared so the memory
        plan can charge it before the KV pool is sized."""
        return cls.workspace_bytes

    def graph_plan(self, batch_size: int, seq_lens: np.ndarray, page_table: np.ndarray) -> None:
        """Host-side work a captured decode step of ``batch_size`` rows needs, run outside
        the graph before its capture and before each replay (the default: none).

        Args:
            seq_lens: ``[batch_size]`` int64, KV length of each row after the step (0 for
                a padding row).
            page_table: ``[batch_size, W]`` int64, each row's pages in order (a padding
                row's entries are not meaningful).
        """
        return None

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata for ``batch``; called once before the layers run."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        kv_stored: bool = False,
        quantize: bool = False,
    ):
        """Store the new keys/values and attend.

        Args:
            q: ``[T, num_heads, head_dim]``.
            k, v: ``[T, num_kv_heads, head_dim]``, written to ``batch.out_slots``.
            layer: layer index into the pool.
            kv_stored: the caller already wrote ``k``/``v`` (rotated) into the pool at
                ``batch.out_slots`` (the model's fused rotary + store kernel); the
                backend then skips its store and reads them from the pool.
            quantize: the output feeds an int8 GEMV (the o projection in GGUF blocks,
                :meth:`~engine.layers.linear.gguf_blocks.QuantLinear.wants_int8`): return
                ``(out, q8)`` (:meth:`attend_quantized`).

        Returns:
            ``[T, num_heads * head_dim]`` in ``q``'s dtype: causal attention of each new
            token over its sequence's cached prefix and the new tokens up to itself.
        """
        if not kv_stored:
            self.pool.store(layer, batch.out_slots, k, v)
        return self.attend_quantized(q, layer, batch) if quantize else self.attend(q, layer, batch)

    def attend_quantized(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, object]:
        """:meth:`attend`, and its output's rows quantized for the int8 GEMV by the
        launch that writes them (:class:`kernels.quant.triton_activations.Q8Activations`) where
        the backend can, else None (the default: the GEMV then quantizes them itself)."""
        return self.attend(q, layer, batch), None

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Attention of ``q`` (``[T, num_heads, head_dim]``) over the pool, whose layer
        ``layer`` already holds the step's keys and values; ``[T, num_heads * head_dim]``
        (see :meth:`forward`)."""


_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls

    return deco


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered under ``name`` (its :meth:`AttentionBackend.workspace_size`
    is what the plan charges before anything is allocated).

    Raises:
        ValueError: no backend of that name; the message lists the known ones.
    """
    # Importing these registers the built-in backends; none imports Triton or FlashInfer
    # until a backend is built.
    import engine.layers.attention.flashinfer_backend  # noqa: F401
    import engine.layers.attention.torch_backend  # noqa: F401
    import engine.layers.attention.triton_backend  # noqa: F401

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]


def create_attention_backend(name: str, pool: KVPool, **kwargs) -> AttentionBackend:
    """Build the backend registered under ``name``.

    Raises:
        ValueError: no backend of that name; the message lists the known ones.
    """
    return backend_class(name)(pool, **kwargs)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend ``name`` stands for on a device of ``device_type`` (``"cuda"``,
    ``"cpu"``). ``auto`` is ``triton`` on CUDA when Triton is installed, else ``torch``;
    FlashInfer is picked only when asked for: it compiles its kernels on first use with
    the CUDA toolkit (measured on an H200: about 10 s for the decode module and 68 s for
    the prefill one, per cold cache), where Triton needs no toolkit. The choice is
    logged with its reason.

    Raises:
        ValueError: an unknown name, or a backend that cannot run here (``triton`` or
            ``flashinfer`` without CUDA or without the package); the message names the fix.
    """
    if name not in BACKEND_CHOICES:
        try:
            backend_class(name)  # another registered backend (tests register their own)
        except ValueError:
            raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}") from None
        return name
    if name == "auto":
        if device_type != "cuda":
            log.info("attention backend: torch (auto: the device is %s; the GPU kernels need CUDA)", device_type)
            return "torch"
        if not _importable("triton"):
            log.info("attention backend: torch (auto: Triton is not installed; pip install triton for the GPU kernels)")
            return "torch"
        log.info("attention backend: triton (auto: CUDA device, Triton installed; "
                 "--attention-backend flashinfer uses FlashInfer when it is installed)")
        return "triton"
    if name in ("triton", "flashinfer"):
        if device_type != "cuda":
            raise ValueError(f"--attention-backend {name} needs a CUDA device; use torch or auto on {device_type}")
        package = "triton" if name == "triton" else "flashinfer"
        if not _importable(package):
            pip_name = "triton" if name == "triton" else "flashinfer-python"
            raise ValueError(f"--attention-backend {name} needs the {package} package: pip install {pip_name}, "
                             "or use --attention-backend auto")
    log.info("attention backend: %s (asked for)", name)
    return name
