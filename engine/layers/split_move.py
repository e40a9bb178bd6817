"""A split model's boundary moved while requests run (``--cpu-layers auto``): the device's
last decoder layers handed to the CPU, or the CPU's first layers handed back.

The device pool and the host pool (:mod:`engine.layers.host_layers`) address the same
page ids and slots, so a move carries only buffers, never a request's state:

- :func:`layers_to_host` (the boundary moves down by ``k``): each layer's weights go to
  host memory in the CPU path's form, as :func:`~engine.layers.host_layers.split_model`
  makes it (GGUF blocks un-repacked to the file's layout and kept,
  :func:`~engine.layers.host_layers.file_form`, then packed for the C kernels; dense
  weights float32); the layers' keys and values are copied from the device pool's
  buffers into new host pool buffers (cast to float32 where the pools hold plain
  floats), then the device's buffers are dropped and, on CUDA, the allocator's cache
  emptied so that the device sees the memory come back.
- :func:`layers_to_device` (up by ``k``): the reverse. The weights are rebuilt from the
  file form kept on the host (moved to the device and repacked for its kernels as the
  loader does); nothing is read from the model file again. The kept file form shares its
  blocks with the packed module where the C kernels read them as stored (Q4_0, Q4_1,
  Q8_0); blocks the CPU path repacks (the K-quants, into torch's int4 layout) cost their
  file bytes a second time in host memory, which the plan's host price of a split that
  may move counts (:func:`engine.loader.gguf_quant.gguf_weight_size`'s ``file_forms``).
  Keys and values computed in
  float32 on the host are rounded to the device pool's dtype, as the device's own layers
  store them. A layer that does not fit (``torch.OutOfMemoryError``) goes back to the
  host with the ones after it: the split stays consistent where it stopped.

Both rebuild what holds the old layout: the C decode layers over each part (on a CPU
"device", the device part's too) and each layer's index into its pool. CUDA graphs read
the old addresses: the engine drops them before a move (``Engine.move_split``).

Timing (the default model, SmolLM2-135M in Q4_1 with 30 layers, on 2 shared CPU cores,
the "device" the CPU too, a 128 MiB pool of 182 pages of 16 tokens, 4.3 MiB of keys and
values a layer): one layer moved in 18-21 ms either way, ten in 94-191 ms down and
152-204 ms back up; the KV copy and the C decode layers' rebuild take most of it.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from engine.kvcache.pool import KVPool
from engine.layers.cpu_decode import CpuDecode
from engine.layers.cpu_pack import pack_linears
from engine.layers.host_layers import HostLayers, dense_to, file_form
from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear, repack_model_for_kernels
from kernels.quant.repack import to_gguf_blocks

log = logging.getLogger("headroom.engine")


def cpu_layer_count(model: nn.Module) -> int:
    """The decoder layers ``model`` runs on the CPU now (0 without a split)."""
    host = model.host_layers
    return 0 if host is None else len(host.layers)


def layers_to_host(model: nn.Module, k: int, device_pool: KVPool, lib: ctypes.CDLL | None, *,
                   kv_cache_dtype: str, page_size: int, max_batch: int) -> None:
    """Move the device's last ``k`` decoder layers of ``model`` to the CPU, with their
    keys and values out of ``device_pool`` (module docstring). ``lib``: the C CPU
    kernels, or None. Between steps only.

    Raises:
        ValueError: ``k < 1``, or ``k`` that leaves no layer on the device.
    """
    layers, host = model.model.layers, model.host_layers
    start = len(layers) if host is None else host.start
    if not 1 <= k < start:
        raise ValueError(f"cannot move {k} layers to the CPU: {start} are on the device and one stays; "
                         f"move 1 to {start - 1}")
    new_start = start - k
    moving = list(layers[new_start:start])
    on_cpu = device_pool.device.type == "cpu"
    forms = {i: _to_host_form(layer, lib) for i, layer in enumerate(moving, new_start)}
    if host is None:
        if model.cos_sin_cache is None:
            model.init_rope_cache()
        cos_sin = model.cos_sin_cache.float().cpu().contiguous()
        host = HostLayers(model.config, moving, new_start, kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                          cos_sin=cos_sin, cpu_decode=None, max_batch=max_batch)
        host.follow(device_pool.num_pages)
        del host.pool.k_buffers[:], host.pool.v_buffers[:]
        host.pool.num_layers = 0
        model.host_layers = host
    else:
        host.layers[0:0] = moving
        host.start = new_start
    _hand_over(device_pool, new_start, start, host.pool, 0)
    host.file_forms.update({i: f for i, f in forms.items() if f})
    _renumber(model)
    _rebuild_decode(model, lib, on_cpu)


def layers_to_device(model: nn.Module, k: int, device_pool: KVPool, device: torch.device, dtype: torch.dtype,
                     lib: ctypes.CDLL | None) -> int:
    """Move the CPU's first ``k`` decoder layers of ``model`` back to ``device``, with
    their keys and values into ``device_pool`` (module docstring); returns the layers
    moved (fewer than ``k`` when the device ran out of memory part way). Between steps
    only.

    Raises:
        ValueError: ``k < 1``, or more layers than the CPU runs.
    """
    host = model.host_layers
    count = cpu_layer_count(model)
    if not 1 <= k <= count:
        raise ValueError(f"cannot move {k} layers to the device: the CPU runs {count}; move 1 to {count}")
    on_cpu = device.type == "cpu"
    moved = 0
    try:
        for layer in host.layers[:k]:
            index = host.start
            try:
                _to_device_form(layer, host.file_forms.get(index, {}), device, dtype, lib)
            except torch.OutOfMemoryError:
                _to_host_form(layer, lib)  # back as it was (its file form again)
                raise
            try:
                _hand_over(host.pool, 0, 1, device_pool, index)
            except torch.OutOfMemoryError:
                _to_host_form(layer, lib)
                raise
            host.file_forms.pop(index, None)
            del host.layers[0]
            host.start += 1
            moved += 1
    except torch.OutOfMemoryError:
        log.warning("decoder layer %d did not fit back on %s: %d of %d moved", host.start, device, moved, k)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not host.layers:
        model.host_layers = None
    _renumber(model)
    _rebuild_decode(model, lib, on_cpu)
    return moved


def _hand_over(src: KVPool, lo: int, hi: int, dst: KVPool, at: int) -> None:
    """Layers ``lo..hi-1`` of ``src`` become layers ``at..`` of ``dst``: new buffers of
    ``dst``'s layout (its dtype and device; floats cast, FP8 and block bytes copied as
    they are, the two pools' ``--kv-cache-dtype`` being one) filled from ``src``'s, which
    are then dropped (on CUDA the allocator's cache emptied). Both pools have the same
    page count. On ``torch.OutOfMemoryError`` nothing has changed."""
    fresh = KVPool(num_layers=hi - lo, num_pages=src.num_pages, page_size=dst.page_size,
                   num_kv_heads=dst.num_kv_heads, head_dim=dst.head_dim, dtype=dst.dtype, device=dst.device,
                   compute_dtype=dst.compute_dtype)
    for new, old in zip([*fresh.k_buffers, *fresh.v_buffers],
                        [*src.k_buffers[lo:hi], *src.v_buffers[lo:hi]], strict=True):
        new.copy_(old)
    dst.k_buffers[at:at] = fresh.k_buffers
    dst.v_buffers[at:at] = fresh.v_buffers
    dst.num_layers += hi - lo
    del src.k_buffers[lo:hi], src.v_buffers[lo:hi]
    src.num_layers -= hi - lo
    if src.device.type == "cuda":
        torch.cuda.empty_cache()


def _to_host_form(layer: nn.Module, lib: ctypes.CDLL | None) -> dict[str, nn.Module]:
    """``layer`` in host memory in the CPU path's form; returns its GGUF projections in
    the file's layout (empty where they were packed already: a CPU "device")."""
    layer.to("cpu")
    for module in layer.modules():
        if isinstance(module, QuantLinear):
            for i, (spec, w) in enumerate(module.part_views()):
                if spec.type_name is not None:
                    blocks, type_name = to_gguf_blocks(w, spec.type_name)
                    setattr(module, f"part{i}", blocks)
                    module.parts[i] = PartSpec(spec.rows, type_name)
    forms = file_form(layer)
    pack_linears(layer, torch.float32, lib)
    dense_to(layer, torch.float32)
    return forms


def _to_device_form(layer: nn.Module, forms: dict[str, nn.Module], device: torch.device, dtype: torch.dtype,
                    lib: ctypes.CDLL | None) -> None:
    """``layer`` (the CPU path's form) in the device path's: its GGUF projections from
    ``forms`` (their file form), dense weights in ``dtype``, on ``device`` (on the CPU
    packed again for its kernels; on CUDA repacked for the GPU kernels)."""
    for name, module in forms.items():
        parent, _, leaf = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, leaf, module)
    dense_to(layer, dtype)
    if device.type == "cpu":
        pack_linears(layer, dtype, lib)
        return
    layer.to(device)
    if device.type == "cuda":
        repack_model_for_kernels(layer)


def _renumber(model: nn.Module) -> None:
    """Each layer's index into its pool: the model's index on the device, the index
    after the boundary on the host."""
    host = model.host_layers
    start = len(model.model.layers) if host is None else host.start
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer = i if i < start else i - start


def _rebuild_decode(model: nn.Module, lib: ctypes.CDLL | None, on_cpu: bool) -> None:
    """The C decode layers over the layers each part runs now."""
    host = model.host_layers
    if host is not None:
        host.cpu_decode = CpuDecode.build(model, lib, host.layers) if lib is not None else None
    if on_cpu and lib is not None:
        start = len(model.model.layers) if host is None else host.start
        model.cpu_decode = CpuDecode.build(model, lib, model.model.layers[:start])
