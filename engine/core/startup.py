"""What the engine decides before it loads anything: the device, the dtype, the
device's memory as the plan sees it and the attention workspaces it charges (the plan's
knobs: ``PlanKnobs.of``).

Shared by the engine's constructor and ``headroom plan`` (which plans without loading
weights), so both plan the same dtype, backend and runtime on the same device, with the
same kernel switches (:func:`use_kernel_switches`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import CUDA_HINTS, CudaUnavailable, TorchWithoutCuda
from engine.common.faults import check_cuda_init
from engine.common.options import pick
from engine.core.footprint import CUDA_RUNTIME_ESTIMATE_BYTES, make_footprint
from engine.layers.attention.registry import backend_class, resolve_backend_name
from engine.layers.linear.cpu_kernels import cpu_kernels
from engine.loader.fp8 import resolve_quantization
from engine.loader.gguf_quant import gguf_weight_size
from engine.loader.resolve import gguf_file
from engine.loader.weight_size import WeightSize, fp8_weight_size, weight_bytes
from engine.memory.device import nvml_index, probe_nvml, simulated_device
from engine.memory.host import host_memory
from engine.memory.ledger import make_plan
from engine.memory.plan import DeviceMemory, MemoryPlan, PlanKnobs, running_requests
from kernels.switches import KernelSwitches, configure

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def use_kernel_switches(config: EngineConfig) -> None:
    """Hand ``config``'s kernel switches (``--quant-int8``, ``--pdl``, ...: the fields of
    :data:`engine.common.config.KernelOptions`) to the kernels
    (:func:`kernels.switches.configure`), before anything is planned, loaded or launched:
    the plan prices the CPU kernels' layout, the loader repacks by them."""
    configure(pick(config, KernelSwitches))


def resolve_device(name: str) -> torch.device:
    """``"auto"`` is CUDA when available, else the CPU on a machine without an NVIDIA GPU.

    Never falls back to the CPU silently: only ``cpu`` (or ``auto`` where NVML sees no
    GPU) runs there.

    Raises:
        CudaUnavailable: ``cuda[:N]`` asked for, or ``auto`` on a machine where NVML sees
            an NVIDIA GPU, and CUDA cannot be initialised (after a suspend, a driver still
            loading or updated); the message says why and what helps. Also the test-only
            ``cuda_init`` fault (:func:`engine.common.faults.check_cuda_init`).
    """
    if name == "cpu":
        return torch.device("cpu")
    check_cuda_init()
    if torch.cuda.is_available():
        return torch.device("cuda" if name == "auto" else name)
    if name == "auto":
        present = probe_nvml(0)
        if present is None:
            return torch.device("cpu")
        where = f"NVML sees {present.name}"
    else:
        where = f"--device {name} asks for a GPU"
    if torch.version.cuda is None and torch.version.hip is None:
        # No driver hint can help a torch built without a GPU backend.
        raise TorchWithoutCuda(
            f"{where} but the installed torch {torch.__version__} is built without CUDA; install a CUDA build "
            "into this Python (e.g. `pip install --force-reinstall torch --index-url "
            "https://download.pytorch.org/whl/cu128`) or use --device cpu")
    raise CudaUnavailable(f"{where} but CUDA failed to initialise ({_cuda_init_error()}); {CUDA_HINTS}")


def _cuda_init_error() -> str:
    """CUDA's own reason for not starting, as torch reports it."""
    try:
        torch.cuda.init()
    except Exception as exc:
        return str(exc).partition("\n")[0] or type(exc).__name__
    return "torch sees no CUDA device"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on CPU (CPU bf16 matmuls are slow).

    Raises:
        ValueError: an unknown dtype name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def device_memory(config: EngineConfig, device: torch.device) -> DeviceMemory | None:
    """The device as the plan sees it now: simulated when asked, NVML (or the CUDA
    driver's free/total) on a GPU, None for a plain CPU run (no plan)."""
    try:
        _, host_available = host_memory()
    except OSError:  # no page count on this platform: the split is not checked against it
        host_available = None
    if config.device_total is not None:
        return dataclasses.replace(simulated_device(config.device_total, config.device_free,
                                                    display_attached=config.device_display),
                                   host_available_bytes=host_available)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    snap = probe_nvml(nvml_index(index))
    if snap is not None:
        return dataclasses.replace(snap, host_available_bytes=host_available)
    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    return DeviceMemory(name=name, total_bytes=total, free_bytes=free, others_bytes=total - free,
                        host_available_bytes=host_available)


def attention_workspaces(backend: str, mc: ModelConfig, max_running_requests: int) -> tuple[tuple[str, int], ...]:
    """The plan's workspace lines for attention backend ``backend`` (a resolved name)."""
    size = backend_class(backend).workspace_size(
        num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, max_batch=max_running_requests)
    return ((f"attention backend ({backend})", size),)


# On CUDA, a GGUF whose weights dequantized take less than this stays dequantized by
# default: its decode step is bound by kernel launches, not by reading the weights, so
# the blocks save memory it does not need and the dense kernels are as fast or faster
# (the 135M default model: 946 tokens/s at batch 1 dequantized on an H200). Above it the
# blocks are read at a quarter to a third of the bytes, and a 7-14B model fits a desktop
# card only in them.
SMALL_DENSE_BYTES = 1 << 30


def quantized_gguf(config: EngineConfig, device: torch.device, mc: ModelConfig | None = None) -> Path | None:
    """The GGUF file whose projections load in block format, or None (every weight is
    dequantized into the model dtype at load).

    Blocks are kept when asked for (``--gguf-quantized``), and by default (unset) for a
    ``--model`` that is a GGUF file on the CPU, and on CUDA unless the model dequantized
    is under :data:`SMALL_DENSE_BYTES` (then bfloat16: the log says which and why); not by
    default with another weight format asked for or tensor parallel. On CUDA the block
    kernels run them, on the CPU the C kernels (or torch's int4 layout). A mixture of
    experts (``mc``) keeps its routed experts in blocks too on CUDA (the fused MoE over
    blocks), also those that ``--cpu-experts`` puts in host memory (the host tier and the
    expert cache hold the blocks: :mod:`engine.layers.moe.expert_cache`); on the CPU too
    where the C kernels read their types (:mod:`kernels.cpu.moe_experts`: the K-quants,
    Q4_0/Q4_1/Q8_0, MXFP4), else they are dequantized at load (logged where the kernels
    are off).
    """
    wanted = config.gguf_quantized
    if device.type not in ("cuda", "cpu"):
        return None
    if wanted is None:  # auto
        wanted = config.quantization == "auto" and config.tensor_parallel_size == 1 and (
            device.type == "cpu" or _blocks_by_default_on_cuda(config, mc))
    if not wanted:
        return None
    path = gguf_file(config.model)
    if path is not None and mc is not None and mc.is_moe and device.type == "cpu" \
            and mc.architecture != "GptOssForCausalLM" and cpu_kernels() is None:  # MXFP4 stays in blocks
        log.info("--gguf-quantized on the CPU without the C kernels: the routed experts are dequantized at load")
    return path


def _blocks_by_default_on_cuda(config: EngineConfig, mc: ModelConfig | None) -> bool:
    """Whether a GGUF keeps its blocks on CUDA when ``--gguf-quantized`` is unset (logged
    with the reason when the model is a GGUF file)."""
    if gguf_file(config.model) is None:
        return False
    dense = None if mc is None else weight_bytes(mc, torch.bfloat16)
    if dense is not None and dense < SMALL_DENSE_BYTES:
        log.info("GGUF weights dequantized to bfloat16 (%.0f MiB): under %d MiB a decode step is bound by kernel "
                 "launches, not weight reads; --gguf-quantized keeps the blocks", dense / 2**20, SMALL_DENSE_BYTES >> 20)
        return False
    log.info("GGUF weights kept in their blocks on CUDA (%s in bfloat16); --no-gguf-quantized dequantizes them",
             "size unknown" if dense is None else f"{dense / 2**30:.1f} GiB")
    return True


class WeightFormat(NamedTuple):
    """How the model's projections load and what its weights are priced at.

    ``quantized_gguf``: the GGUF file kept in block format (:func:`quantized_gguf`), or
    None. ``quantization``: ``"fp8"`` for FP8 projections
    (:func:`engine.loader.fp8.resolve_quantization`; never with blocks), else None.
    ``size``: the weights' exact device bytes for either format, None for dense tensors
    in the model dtype (the plan prices those from the shapes).
    """

    quantized_gguf: Path | None
    quantization: str | None
    size: WeightSize | None


def weight_format(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, mc: ModelConfig, model_dir: Path
) -> WeightFormat:
    """The :class:`WeightFormat` the engine loads ``model_dir`` in on ``device`` (``mc``:
    this rank's config); from the config and the GGUF's tensor table, no weight read.

    Raises:
        engine.common.load_errors.UnsupportedConfig: FP8 asked for where it cannot load.
    """
    gguf = quantized_gguf(config, device, mc)
    if gguf is not None:
        size = gguf_weight_size(gguf, mc, dtype, device.type)
        # --cpu-layers keeps layers in the CPU path's layout: priced per layer as such, in
        # the C kernels' blocks (asking whether they build would compile them on every
        # GPU start, split or not; where they do not, the measured plan corrects it); a
        # split that may move (auto) keeps the blocks the CPU path repacks in their file
        # form too, to move them back up from the CPU to a GPU (engine.layers.split_move).
        moves = config.cpu_layers == "auto" and device.type != "cpu"
        host = size if device.type == "cpu" and not moves else gguf_weight_size(
            gguf, mc, torch.float32, "cpu", cpu_blocks=True, file_forms=moves)
        return WeightFormat(gguf, None, dataclasses.replace(size, host_layer_bytes=host.decoder_layer_bytes))
    quantization = resolve_quantization(config.quantization, model_dir)
    return WeightFormat(None, quantization, fp8_weight_size(mc, dtype) if quantization == "fp8" else None)


def estimated_planner(
    config: EngineConfig,
    mc: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    memory: DeviceMemory,
    weights: WeightSize | None = None,
) -> Callable[[PlanKnobs], MemoryPlan]:
    """The plan from estimates (before any weight loads) as a function of the knobs, for
    :func:`engine.memory.ledger.fit_plan`: the attention backend ``auto`` resolves for
    ``device`` and the CUDA context is charged at its estimate (a planned device is a GPU
    or a simulated one). ``weights`` prices a GGUF loaded in block format
    (:func:`engine.loader.gguf_quant.gguf_weight_size`); None prices the dense tensors."""
    backend = resolve_backend_name(config.attention_backend, device.type, windows=bool(mc.kv_windows),
                                   softcap=bool(mc.attn_logit_softcapping), sinks=mc.attention_sinks,
                                   kv_cache_dtype=config.kv_cache_dtype)
    workspaces = attention_workspaces(backend, mc, running_requests(config))
    gathers = backend_class(backend).gathers_context

    def plan(knobs: PlanKnobs) -> MemoryPlan:
        fp = make_footprint(mc, dtype, knobs, workspaces=workspaces, runtime_bytes=CUDA_RUNTIME_ESTIMATE_BYTES,
                            weights=weights, gathers_context=gathers)
        return make_plan(memory, knobs, fp)

    return plan
