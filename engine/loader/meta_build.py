"""A model built on the meta device (shapes, no storage) and given uninitialized storage
afterwards: how every load builds its model, so weights are written once, straight into
their final place, and how the sizes are computed without allocating."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine.common.config import ModelConfig
from engine.layers.linear.fp8 import swap_projections
from engine.models.decoder import CausalLM
from engine.models.registry import get_model_class


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Skip ``torch.nn.init`` while modules are built on the meta device: the weights are
    loaded afterwards, and a meta ``normal_`` goes through torch's Python references, which
    import torch._dynamo and with it Triton (74 MB of resident memory on the CPU path)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_on_meta(config: ModelConfig, dtype: torch.dtype | None = None, quantization: str | None = None) -> CausalLM:
    """The model on the meta device, cast to ``dtype`` (when given), its projections
    FP8 when ``quantization == "fp8"`` (swapped after the cast, which would upcast them)."""
    with torch.device("meta"), _no_weight_init():
        model = get_model_class(config.architecture)(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    if quantization == "fp8":
        swap_projections(model, dtype or torch.get_default_dtype())
    return model


def materialize(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Give every parameter and buffer of ``model`` (built on the meta device) storage on
    ``device``, uninitialized, in place: what ``Module.to_empty`` does, through
    ``torch.empty`` of each shape and dtype. ``to_empty`` calls ``torch.empty_like`` on
    meta tensors, which runs torch's Python reference of it and imports sympy: 40 MiB of
    resident memory the CPU engine never uses (measured on the default model: 367 MiB
    after load with ``to_empty``, 333 MiB with this). Tensors are laid out contiguously;
    ties between modules are broken, as ``to_empty`` breaks them. Returns ``model``."""
    # _apply is how Module.to/to_empty reach each parameter and buffer (keeping Parameter
    # wrappers and requires_grad); only the function applied differs.
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
