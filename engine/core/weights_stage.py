"""The engine's weights stage: the model read onto its device, or split with host memory
where the plan (or the options on an unplanned CPU) asks: a mixture of experts' routed
experts of ``--cpu-experts`` behind a device expert cache
(:mod:`engine.layers.moe.offload`), a dense model's last decoder layers of
``--cpu-layers`` run by the CPU (:mod:`engine.layers.host_layers`).

:class:`WeightsStage` is a part of :class:`engine.core.engine.Engine` (it uses the
engine's ``config``, ``device``, ``dtype``, ``plan``, ``knobs``, ``model_dir``,
``quantized_gguf`` and ``quantization``, and sets ``model``, ``expert_stores``,
``expert_counters`` and ``cpu_layers``).
"""

from __future__ import annotations

import dataclasses
import logging

from engine.common.config import ModelConfig
from engine.layers.cpu_pack import pack_model_for_cpu
from engine.layers.host_layers import split_model
from engine.layers.linear.cpu_kernels import cpu_kernels
from engine.layers.linear.gguf_blocks import repack_model_for_kernels
from engine.layers.moe.expert_cache import OffloadedExperts
from engine.layers.moe.expert_counters import ExpertCounters
from engine.layers.moe.offload import offload_experts, resize_cache
from engine.loader.load import load_model
from engine.memory.host import trim_host_heap
from engine.parallel.group import TensorParallel

log = logging.getLogger("headroom.engine")


def idle_cpu_share(expert_cpu_share: str, expert_bus_reads: bool, device_type: str, host_layers: int) -> str | None:
    """Why ``--expert-cpu-share auto`` does nothing on this engine (every reason that
    applies, joined), or None where it runs or is off. It splits the experts a CUDA
    decode step reads from host memory over the bus, so it needs CUDA, MoE layers whose
    routed experts live in host memory (``host_layers``, from ``--cpu-experts``) and bus
    reads on. A kernel switch (a config file may set it for every model): logged, never
    refused."""
    if expert_cpu_share != "auto":
        return None
    why = []
    if device_type != "cuda":
        why.append(f"the engine runs on {device_type}, not CUDA (no decode step reads experts over the bus)")
    if host_layers == 0:
        why.append("no mixture-of-experts layer keeps its routed experts in host memory (a dense model, "
                   "or --cpu-experts none)")
    if not expert_bus_reads:
        why.append("--no-expert-bus-reads: missing experts are copied or run on the CPU, not read over the bus")
    return "; ".join(why) or None


class WeightsStage:
    """The engine's weights stage (see the module docstring)."""

    # Decoder layers run on the CPU (--cpu-layers); 0 until the weights load.
    cpu_layers = 0

    def _cpu_layer_count(self) -> int:
        """The last decoder layers the CPU runs: the plan's choice on a planned device,
        else a number ``--cpu-layers`` gives (``auto`` is 0: nothing to fit)."""
        if self.plan is not None:
            return self.plan.cpu_layers
        asked = self.config.cpu_layers
        return int(asked) if asked.isdecimal() else 0

    def _load_weights(self, mc: ModelConfig, tp: TensorParallel | None) -> None:
        """Read the weights (module docstring) into ``self.model``."""
        config = self.config
        # With a hybrid plan (--cpu-experts) the model is read into host memory, the
        # chosen layers' routed experts stay there behind a device expert cache, and
        # the rest moves to the device. A GGUF read in blocks is read in the device's
        # layout (experts in blocks on CUDA), so the host tier holds the blocks.
        self.expert_stores: list[OffloadedExperts] = []
        self.expert_counters: ExpertCounters | None = None
        host_layers = self.plan.cpu_expert_layers if self.plan is not None else 0
        self.cpu_layers = self._cpu_layer_count()
        idle = idle_cpu_share(config.expert_cpu_share, config.expert_bus_reads, self.device.type, host_layers)
        if idle is not None:
            log.info("--expert-cpu-share auto does nothing here: %s", idle)
        if self.plan is None and mc.is_moe and config.cpu_experts not in ("auto", "none"):
            # No device to plan for (the CPU without a simulated --device-total): nothing to split.
            log.warning("--cpu-experts %s has no effect on %s without a planned device (--device-total): every "
                        "weight is in host memory already", config.cpu_experts, self.device)
        on_host = dict(load_format=config.load_format, quantized_gguf=self.quantized_gguf,
                       quantization=self.quantization, embeddings_in_blocks=self.device.type == "cpu")
        # The measured plan prices the layers and experts where they were loaded (an auto
        # placement it cannot fit moves more experts: PlanStages._fit_measured).
        self.knobs = dataclasses.replace(self.knobs, cpu_layers=str(self.cpu_layers), cpu_experts=str(host_layers))
        if host_layers:
            self.model, _ = load_model(self.model_dir, "cpu", self.dtype, **on_host,
                                       experts_in_blocks=self.device.type != "cpu")
            layers = mc.moe_layers[-host_layers:]
            self.expert_stores, self.expert_counters = offload_experts(
                self.model, layers, 0, device=self.device)
            self.model.to(self.device)
            if self.device.type == "cuda":
                repack_model_for_kernels(self.model)  # read on the host: repacked once on the device
            resize_cache(self.expert_stores, self.plan.expert_cache_slots)
            log.info("routed experts of %d of %d MoE layers in host memory; expert cache of %d slots",
                     host_layers, len(mc.moe_layers), self.plan.expert_cache_slots)
        elif self.cpu_layers:
            if self.quantization == "fp8":
                raise ValueError(f"--cpu-layers {self.cpu_layers} does not go with FP8 weights (the CPU runs no FP8 "
                                 "projections): use --cpu-layers 0, or a bfloat16 checkpoint or GGUF")
            self.model, _ = load_model(self.model_dir, "cpu", self.dtype, **on_host)
            lib = cpu_kernels() if self.quantized_gguf is not None else None  # the GGUF blocks' C kernels
            split_model(self.model, self.cpu_layers, self.device, lib, kv_cache_dtype=config.kv_cache_dtype,
                        page_size=config.page_size, max_batch=self.knobs.max_running_requests,
                        keep_file_form=config.cpu_layers == "auto")  # the split may move back up
            if self.device.type == "cuda":
                repack_model_for_kernels(self.model)  # the device part's blocks, once on the device
            trim_host_heap()
            return
        else:
            self.model, _ = load_model(self.model_dir, self.device, self.dtype, **on_host, tp=tp)
        if self.quantized_gguf is not None and self.device.type == "cpu":
            pack_model_for_cpu(self.model, self.dtype, cpu_kernels())  # the block kernels are GPU kernels
            trim_host_heap()  # the freed blocks and file tables would stay resident

    def _offload_more_experts(self, host_layers: int) -> None:
        """Move the routed experts of the last ``host_layers`` MoE layers (those in host
        memory already included) off the device, behind the expert cache with the layers
        there before (their counters and live rows shared), and price them so in
        ``knobs``. The measured plan's re-placement; between steps only.

        Raises:
            ValueError: ``host_layers`` is not more than the layers in host memory now.
        """
        loaded = len(self.expert_stores)
        moe_layers = self.model_config.moe_layers
        if not loaded < host_layers <= len(moe_layers):
            raise ValueError(f"{host_layers} MoE layers' experts in host memory: not more than {loaded} now "
                             f"and at most {len(moe_layers)}")
        layers = tuple(moe_layers[-host_layers:len(moe_layers) - loaded])
        like = self.expert_stores[0] if self.expert_stores else None
        stores, self.expert_counters = offload_experts(self.model, layers, 0, device=self.device, like=like)
        self.expert_stores = stores + self.expert_stores  # in layer order
        self.knobs = dataclasses.replace(self.knobs, cpu_experts=str(host_layers))
        trim_host_heap()
