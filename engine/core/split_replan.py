"""The live replan's last rung: a split model's boundary (``--cpu-layers auto``) moved
while requests run, when the KV pool is at its floor and the device is still short, and
moved back when memory returns (``service.vram.replan`` decides when).

:class:`SplitReplan` is a part of :class:`engine.core.engine.Engine` (it uses the
engine's ``model``, ``pool``, ``runner``, ``plan``, ``info``, ``knobs``, ``config``,
``model_config``, ``device``, ``dtype``, ``weight_size``, ``quantized_gguf``,
``quantization``, ``expert_stores``, ``tp`` and ``cpu_layers``, and LiveReplan's
``_replanned``); the layers' work is :mod:`engine.layers.split_move`'s. A move queues a
``Replanned`` event (``REPLAN_MOVE_LAYERS``) and logs the layers, the bytes and the time.

The CUDA graphs (decode and one-sequence prefill) read the pool's old buffers and run the
whole model on the device: a move drops them, and a split model decodes eagerly. They are
kept aside, empty, and used again (captured on next use) once every layer is back on the
device.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec
import torch

from engine.common.units import fmt_bytes
from engine.core.settings_fit import splittable
from engine.kvcache.pool import kv_storage_dtype
from engine.layers.linear.cpu_kernels import cpu_kernels
from engine.layers.split_move import cpu_layer_count, layers_to_device, layers_to_host
from engine.layers.weight_census import model_weight_bytes
from engine.loader.weight_size import layer_weight_bytes
from engine.memory.host import host_memory
from engine.wire.messages import BY_WATCHER, REPLAN_MOVE_LAYERS, ReplanOrigin

log = logging.getLogger("headroom.engine")


class SplitReplan:
    """The engine's split moves (see the module docstring)."""

    _parked_graphs: tuple | None = None  # the runner's CUDA graphs while the model is split
    _layer_prices: tuple[int, ...] | None = None
    _planned_split: int | None = None  # the start's split, once it moved

    @property
    def split_fixed_reason(self) -> str:
        """Why this engine's split cannot move ("" when it can): a ``--cpu-layers`` number
        (the user's choice), a model or a setting the split does not serve."""
        if self.config.cpu_layers != "auto":
            return (f"--cpu-layers {self.config.cpu_layers} is fixed: the split moves live only with "
                    "--cpu-layers auto")
        if not splittable(self.model_config):
            return (f"{self.model_config.architecture} does not split its layers between the device and the CPU "
                    "(only dense Llama/Qwen2/Qwen3-family models do)")
        if self.tp is not None or self.expert_stores or self.quantization == "fp8":
            return "the split does not go with tensor parallelism, --cpu-experts or FP8 weights"
        if self.device.type == "cpu" and self.dtype != torch.float32:
            return f"on the CPU the split moves with float32 weights only, not {self.dtype}"
        return ""

    @property
    def planned_cpu_layers(self) -> int:
        """The layers the CPU ran at the start (the plan's split): moves back up stop
        there."""
        return self.cpu_layers if self._planned_split is None else self._planned_split

    @property
    def max_cpu_layers(self) -> int:
        """The most decoder layers the split may move to the CPU (one stays on the
        device); 0 where it cannot move (:attr:`split_fixed_reason`)."""
        return 0 if self.split_fixed_reason else self.model_config.num_layers - 1

    @property
    def layer_device_bytes(self) -> tuple[int, ...]:
        """Each decoder layer's weights on the device as the plan prices them (a GGUF's
        blocks as stored, else dense in the model dtype)."""
        if self._layer_prices is None:
            ws = self.weight_size
            self._layer_prices = (tuple(ws.decoder_layer_bytes) if ws is not None and ws.decoder_layer_bytes
                                  else layer_weight_bytes(self.model_config, self.dtype))
        return self._layer_prices

    def move_split(self, cpu_layers: int, *, reason: str = "", origin: ReplanOrigin = BY_WATCHER) -> int:
        """Run the last ``cpu_layers`` decoder layers on the CPU from the next step on,
        moving the boundary down (layers to the CPU) or up (back to the device) between
        steps; running requests keep their pages and go on (:mod:`engine.layers.split_move`).
        Returns the layers the CPU runs now: fewer than asked when a move up ran out of
        device memory part way (the layers that did not fit stay on the CPU). A
        ``Replanned`` event is queued when the split moved; the plan (``info.plan``)
        carries the split now, its fixed bytes and KV page bytes the device's share.

        Takes 10-20 ms a layer of the default model on a CPU (measured in the module
        docstring of :mod:`engine.layers.split_move`); on a GPU the weights' copy over
        the bus adds their bytes at its bandwidth.

        A move down takes host memory (the layers' weights in the CPU path's form, their
        KV for every page of the pool, as the plan prices a split): it stops at the most
        layers that fit in what the host has available (:meth:`layers_host_holds`).

        Raises:
            ValueError: a split that cannot move (:attr:`split_fixed_reason`),
                ``cpu_layers`` outside ``0..max_cpu_layers``, or a move down of which not
                one layer fits in the host's available memory.
        """
        why_not = self.split_fixed_reason
        if why_not:
            raise ValueError(f"the split cannot move: {why_not}")
        if not 0 <= cpu_layers <= self.max_cpu_layers:
            raise ValueError(f"cannot run {cpu_layers} decoder layers on the CPU: choose 0 to "
                             f"{self.max_cpu_layers} (one stays on the device)")
        before = cpu_layer_count(self.model)
        if cpu_layers > before:
            cpu_layers = self.layers_host_holds(before, cpu_layers)
        if cpu_layers == before:
            return before
        if self._planned_split is None:
            self._planned_split = before
        started = time.perf_counter()
        before_pages, before_kv, before_kv_pool = self.pool.num_pages, self.pool.nbytes, self.pool.usable_bytes
        self._park_graphs()
        lib = cpu_kernels() if self.quantized_gguf is not None else None
        if cpu_layers > before:
            layers_to_host(self.model, cpu_layers - before, self.pool, lib, kv_cache_dtype=self.config.kv_cache_dtype,
                           page_size=self.config.page_size, max_batch=self.knobs.max_running_requests)
        else:
            layers_to_device(self.model, before - cpu_layers, self.pool, self.device, self.dtype, lib)
        after = cpu_layer_count(self.model)
        if after == 0:
            self._unpark_graphs()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.cpu_layers = after
        self.knobs = dataclasses.replace(self.knobs, cpu_layers=str(after))
        n = self.model_config.num_layers
        weights = sum(self.layer_device_bytes[n - max(before, after):n - min(before, after)])
        weights = weights if after > before else -weights  # given back (taken: negative)
        moved = weights + before_kv - self.pool.nbytes
        self._split_planned(before, after, weights, reason)
        ms = (time.perf_counter() - started) * 1000
        lo, hi = n - max(before, after), n - min(before, after) - 1
        log.info("decoder layers %d-%d moved to the %s in %.1f ms: %s of device memory %s; %d of %d layers on the CPU%s",
                 lo, hi, "CPU" if after > before else "device", ms, fmt_bytes(abs(moved)),
                 "given back" if moved >= 0 else "taken", after, n, f" ({reason})" if reason else "")
        self._replanned(REPLAN_MOVE_LAYERS, reason, origin, before_pages, before_kv, ms,
                        before_cpu_layers=before, moved_bytes=moved, plan=self.plan, before_kv_pool_bytes=before_kv_pool)
        return after

    def layers_host_holds(self, before: int, wanted: int, available: int | None = -1) -> int:
        """The most decoder layers, from ``before`` up to ``wanted``, that the CPU can run
        with ``available`` bytes of host memory (default: the host's ``MemAvailable`` now;
        None: unknown, every layer fits): each layer moved takes its weights in the CPU
        path's form (the plan's host price) and its KV for the pool's pages in the host
        pool's dtype.

        Raises:
            ValueError: not one more layer fits (naming the bytes needed and available).
        """
        if available == -1:
            try:
                available = host_memory()[1]
            except OSError:  # no page count on this platform
                available = None
        if available is None:
            return wanted
        n = self.model_config.num_layers
        ws = self.weight_size
        host = (ws.host_layer_bytes if ws is not None and ws.host_layer_bytes
                else layer_weight_bytes(self.model_config, torch.float32))
        host_kv = kv_storage_dtype(self.config.kv_cache_dtype, torch.float32)
        scale = torch.empty((), dtype=host_kv).element_size() / self.pool.k_buffers[0].element_size()
        kv = int(self.pool.nbytes // self.pool.num_layers * scale)
        need, fits = 0, before
        for layer in range(before + 1, wanted + 1):
            need += host[n - layer] + kv
            if need > available:
                break
            fits = layer
        if fits == before:
            raise ValueError(f"moving decoder layer {n - before - 1} to the CPU needs "
                             f"{fmt_bytes(host[n - before - 1] + kv)} of host memory and {fmt_bytes(available)} is "
                             "available: free host memory first, or give the device memory back another way")
        if fits < wanted:
            log.warning("only %d of %d decoder layers fit in the host's %s available: moving those", fits - before,
                        wanted - before, fmt_bytes(available))
        return fits

    def _park_graphs(self) -> None:
        """Drop the CUDA graphs' captures and keep the runner from replaying them while
        the model is split (module docstring)."""
        runner = self.runner
        runner.pool_will_move()
        if self._parked_graphs is None and (runner.graphs is not None or runner.prefill_graphs is not None):
            self._parked_graphs = (runner.graphs, runner.prefill_graphs)
            runner.graphs = runner.prefill_graphs = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _unpark_graphs(self) -> None:
        if self._parked_graphs is not None:
            self.runner.graphs, self.runner.prefill_graphs = self._parked_graphs
            self._parked_graphs = None

    def _split_planned(self, before: int, after: int, weight_change: int, reason: str) -> None:
        """The plan (and ``info``) after a move: the split, its note, the device's fixed
        bytes less the weights that left (more for those that came back), and the KV
        pool's usable pages' bytes over the layers the device now holds."""
        self.info = msgspec.structs.replace(self.info, kv_cache_bytes=self.pool.usable_bytes,
                                            kv_buffer_bytes=self.pool.nbytes,
                                            weight_bytes=model_weight_bytes(self.model))
        plan = self.plan
        if plan is None:
            return
        n = self.model_config.num_layers
        note = ""
        if after:
            note = (f"decoder layers {n - after}-{n - 1} ({after} of {n}) run on the CPU, moved live from {before}"
                    + (f": {reason}" if reason else "") + "; each step runs them on the CPU, so decode is slower "
                    "and runs without CUDA graphs")
        self.plan = msgspec.structs.replace(plan, cpu_layers=after, split_note=note,
                                            fixed_bytes=plan.fixed_bytes - weight_change,
                                            kv_pool_bytes=self.pool.usable_bytes)
        self.info = msgspec.structs.replace(self.info, plan=self.plan)

