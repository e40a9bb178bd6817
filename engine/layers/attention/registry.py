"""The attention backends by name, and the choice of one for a device.

Built-in backends: ``torch`` (plain torch, any device; the reference), ``triton``
(Triton kernels on CUDA), ``flashinfer`` (FlashInfer's paged wrappers, when the
package imports). Each is imported on first use (:class:`~engine.common.lazy_registry.LazyRegistry`),
so this module and :mod:`engine.layers.attention.base` never import the backends.
``auto`` (:func:`resolve_backend_name`) picks one for the device.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

from engine.common.config import ATTENTION_BACKENDS as BACKEND_CHOICES
from engine.common.config import ModelConfig
from engine.common.errors import SettingRefused
from engine.common.lazy_registry import LazyRegistry
from engine.kvcache.pool import KVPool
from engine.layers.attention.base import AttentionBackend
from kernels.attention.kv_formats import is_block_format
from kernels.switches import current

log = logging.getLogger("headroom.engine")

_BACKENDS = LazyRegistry("attention backend", {
    "triton": "engine.layers.attention.triton_backend:TritonAttentionBackend",
    "flashinfer": "engine.layers.attention.flashinfer_backend:FlashInferAttentionBackend",
    "torch": "engine.layers.attention.torch_backend:TorchAttentionBackend",
})


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """A class decorator that registers a backend under ``name`` (tests register their own)."""
    return _BACKENDS.register(name)


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered under ``name`` (its :meth:`AttentionBackend.workspace_size`
    is what the plan charges before anything is allocated). Importing a built-in
    backend's module imports neither Triton nor FlashInfer: they load when it is built.

    Raises:
        ValueError: no backend of that name; the message lists the known ones.
    """
    try:
        return _BACKENDS.get(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None


def create_attention_backend(name: str, pool: KVPool, **kwargs) -> AttentionBackend:
    """Build the backend registered under ``name``.

    Raises:
        ValueError: no backend of that name; the message lists the known ones.
    """
    return backend_class(name)(pool, **kwargs)


def model_attention(name: str, pool: KVPool, mc: ModelConfig, max_batch: int = 64) -> AttentionBackend:
    """The backend registered under ``name`` for the model ``mc`` over ``pool``: its
    attention scale (:attr:`ModelConfig.attention_scale`), its sliding windows and score
    cap (:meth:`AttentionBackend.use_windows`).

    Raises:
        ValueError: no backend of that name, or one without the model's windows or cap.
    """
    attn = create_attention_backend(name, pool, num_heads=mc.num_heads, head_dim=mc.head_dim,
                                    scale=mc.attention_scale, max_batch=max_batch)
    attn.use_windows(mc.kv_windows, mc.attn_logit_softcapping)
    return attn


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_backend_name(name: str, device_type: str, *, windows: bool = False, softcap: bool = False,
                         sinks: bool = False, kv_cache_dtype: str = "auto") -> str:
    """The backend ``name`` stands for (:func:`_resolve`), refused when it cannot read
    the KV cache's format (``kv_cache_dtype``, a ``--kv-cache-dtype`` name: a block format
    needs a backend whose :attr:`~AttentionBackend.kv_block_formats` hold it).

    Raises:
        ValueError: as :func:`_resolve`.
        SettingRefused: a backend without the KV cache's block format, naming the
            options that fix it.
    """
    if name != "auto" and name in BACKEND_CHOICES:
        _check_kv_format(name, kv_cache_dtype)  # before the device and the package: the first thing to change
    resolved = _resolve(name, device_type, windows=windows, softcap=softcap, sinks=sinks)
    _check_kv_format(resolved, kv_cache_dtype)
    return resolved


def _check_kv_format(name: str, kv_cache_dtype: str) -> None:
    if not is_block_format(kv_cache_dtype) or kv_cache_dtype in backend_class(name).kv_block_formats:
        return
    readers = [n for n in BACKEND_CHOICES if n != "auto" and kv_cache_dtype in backend_class(n).kv_block_formats]
    raise SettingRefused(f"--attention-backend {name} cannot read a KV cache of --kv-cache-dtype "
                         f"{kv_cache_dtype}; use --attention-backend {' or '.join(readers)}, "
                         "or --kv-cache-dtype auto or fp8")


def _resolve(name: str, device_type: str, *, windows: bool, softcap: bool, sinks: bool) -> str:
    """The backend ``name`` stands for on a device of ``device_type`` (``"cuda"``,
    ``"cpu"``). ``auto`` is ``triton`` on CUDA when Triton is installed and the ``kernels``
    switch is not ``torch`` (:mod:`kernels.switches`), else ``torch``;
    FlashInfer is picked only when asked for: it compiles its kernels on first use with
    the CUDA toolkit (measured on an H200: about 10 s for the decode module and 68 s for
    the prefill one, per cold cache), where Triton needs no toolkit. A model whose layers
    slide (``windows``: Gemma 3), whose scores are soft-capped (``softcap``: Gemma 2) or
    whose softmax has sinks (``sinks``: gpt-oss) needs a backend that has them (torch,
    Triton; FlashInfer has none), so ``auto`` serves it as any other.
    The choice is logged with its reason.

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
        if current().kernels == "torch":
            log.info("attention backend: torch (auto: --kernels torch asks for the torch references everywhere)")
            return "torch"
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
        cls = backend_class(name)
        lacks = [what for what, needed, has in (("sliding-window", windows, cls.supports_windows),
                                                 ("soft-capped", softcap, cls.supports_softcap),
                                                 ("sink", sinks, cls.supports_sinks)) if needed and not has]
        if lacks:
            raise ValueError(f"--attention-backend {name} has no {' or '.join(lacks)} attention, "
                             "which this model needs; use torch or auto")
        if device_type != "cuda":
            raise ValueError(f"--attention-backend {name} needs a CUDA device; use torch or auto on {device_type}")
        package = "triton" if name == "triton" else "flashinfer"
        if not _importable(package):
            pip_name = "triton" if name == "triton" else "flashinfer-python"
            raise ValueError(f"--attention-backend {name} needs the {package} package: pip install {pip_name}, "
                             "or use --attention-backend auto")
    log.info("attention backend: %s (asked for)", name)
    return name
