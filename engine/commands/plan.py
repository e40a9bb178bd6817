"""``headroom plan``: print the memory ledger for a model and a device, without serving.

Reads the model's config only (no weights); the activation peak is the estimate the
engine starts from (a served GPU engine replaces it with its profile run's measurement).
"""

from __future__ import annotations

import msgspec
import torch

from engine.attention.base import resolve_backend_name
from engine.config import EngineConfig
from engine.loader.gguf_quant import gguf_weight_size
from engine.loader.hf_config import load_model_config
from engine.loader.resolve import gguf_file, resolve_model
from engine.memory.footprint import CUDA_RUNTIME_ESTIMATE_BYTES, make_footprint
from engine.memory.plan import MemoryPlan, PlanKnobs, make_plan
from engine.startup import attention_workspaces, device_memory, resolve_device, resolve_dtype


class NoDevice(Exception):
    """No GPU to plan for and no simulated device given."""


def build_plan(config: EngineConfig) -> MemoryPlan:
    """The plan the engine would start from for ``config``.

    A simulated device (``device_total``) stands in for a GPU: dtype
    ``auto`` is bfloat16 there, as on a CUDA device.

    Raises:
        NoDevice: neither a CUDA device nor a simulated one; the message names the flags.
        engine.loader.errors.ModelLoadError: the model is missing or its config broken.
    """
    device = resolve_device(config.device)
    simulated = config.device_total is not None
    if not simulated and device.type != "cuda":
        raise NoDevice(
            "no CUDA device here: plan for a simulated card with --device-total SIZE "
            "(and --device-free SIZE), e.g. --device-total 6GiB --device-free 5.5GiB"
        )
    dtype = resolve_dtype(config.dtype, torch.device("cuda") if simulated else device)
    mc = load_model_config(resolve_model(config.model))
    # The plan stands for a GPU: a GGUF keeps its projections in block format there.
    gguf = gguf_file(config.model) if config.gguf_quantized else None
    weights = None if gguf is None else gguf_weight_size(gguf, mc, dtype)
    knobs = PlanKnobs.of(config)
    dev = device_memory(config, device)
    assert dev is not None
    backend = resolve_backend_name(config.attention_backend, "cuda")
    workspaces = attention_workspaces(backend, mc, config.max_running_requests)
    fp = make_footprint(mc, dtype, knobs, workspaces=workspaces, runtime_bytes=CUDA_RUNTIME_ESTIMATE_BYTES,
                        weights=weights)
    return make_plan(dev, knobs, fp)


def render(plan: MemoryPlan, as_json: bool) -> str:
    """The plan as a ledger table (with the fix when it does not fit), or as JSON."""
    if as_json:
        return msgspec.json.encode(plan).decode()
    head = f"memory plan for {plan.device}\n"
    body = plan.table()
    if plan.fits:
        return f"{head}{body}\nfits: yes"
    return f"{head}{body}\nfits: no\n\n{plan.message()}"
