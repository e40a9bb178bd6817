"""``headroom plan``: print the memory ledger for a model and a device, without serving.

Reads the model's config only (no weights); plans the dtype and device ``headroom
serve`` would (:func:`planned_setup`); the activation peak is the estimate the
engine starts from (a served GPU engine replaces it with its profile run's measurement).
"""

from __future__ import annotations

import msgspec
import torch

from engine.config import EngineConfig
from engine.loader.fp8 import resolve_quantization
from engine.loader.gguf_quant import gguf_weight_size
from engine.loader.hf_config import load_model_config
from engine.loader.load import fp8_weight_size
from engine.loader.resolve import resolve_model
from engine.memory.plan import MemoryPlan, PlanKnobs, fit_plan
from engine.startup import (
    device_memory,
    estimated_planner,
    quantized_gguf,
    resolve_device,
    resolve_dtype,
)


class NoDevice(Exception):
    """No GPU to plan for and no simulated device given."""


def planned_setup(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype ``headroom serve`` would plan with ``config``: ``--device``
    as the engine resolves it (``cuda`` with ``--device-total`` is taken as named, so a
    CUDA card can be priced on a machine without one), and dtype ``auto`` for that device (float32 on a CPU,
    even when a simulated card stands in for the GPU's memory).

    Raises:
        NoDevice: neither a CUDA device nor a simulated one; the message names the flags.
        ValueError: an unknown dtype.
    """
    if config.device_total is not None and config.device.startswith("cuda"):
        # A simulated card stands in for the GPU: pricing it needs no CUDA here.
        device = torch.device(config.device)
    else:
        device = resolve_device(config.device)
    if config.device_total is None and device.type != "cuda":
        raise NoDevice(
            "no CUDA device here: plan for a simulated card with --device-total SIZE "
            "(and --device-free SIZE), e.g. --device-total 6GiB --device-free 5.5GiB"
        )
    return device, resolve_dtype(config.dtype, device)


def build_plan(config: EngineConfig) -> MemoryPlan:
    """The plan the engine would start from for ``config``, with the same decisions: the
    prefill chunk lowered, then the context lowered down to ``--min-context``
    (:func:`engine.memory.plan.fit_plan`); a plan that does not fit even so is returned
    with ``fits`` False.

    Raises:
        NoDevice: see :func:`planned_setup`.
        engine.loader.errors.ModelLoadError: the model is missing or its config broken.
    """
    device, dtype = planned_setup(config)
    mc = load_model_config(resolve_model(config.model))
    # Priced as the engine will load it: dense (dequantized) unless --gguf-quantized
    # keeps a GGUF's blocks on a CUDA device.
    gguf = quantized_gguf(config, device, mc)
    weights = None if gguf is None else gguf_weight_size(gguf, mc, dtype, device.type)
    if gguf is None and resolve_quantization(config.quantization, resolve_model(config.model)) == "fp8":
        weights = fp8_weight_size(mc, dtype)
    memory = device_memory(config, device)
    assert memory is not None
    plan, _ = fit_plan(estimated_planner(config, mc, device, dtype, memory, weights=weights), PlanKnobs.of(config))
    return plan


def render(plan: MemoryPlan, as_json: bool, setup: str = "") -> str:
    """The plan as a ledger table (with the fix when it does not fit), or as JSON;
    ``setup`` (e.g. "float32 on cpu") follows the device in the table's head."""
    if as_json:
        return msgspec.json.encode(plan).decode()
    head = f"memory plan for {plan.device}" + (f", {setup}" if setup else "") + "\n"
    body = plan.table()
    if plan.kv_bytes_per_token:
        body += f"\nKV cache: {plan.kv_bytes_per_token:,} bytes per token ({plan.kv_cache_dtype})"
    if plan.context_lowered:
        return f"{head}{body}\nfits: yes, with a lowered context (--min-context {plan.min_context_tokens})"
    if plan.fits:
        return f"{head}{body}\nfits: yes"
    return f"{head}{body}\nfits: no\n\n{plan.message()}"
