"""A dense model's last decoder layers kept on the CPU (``--cpu-layers N``), for a model a
little larger than the card: the device runs the embeddings, the first layers, the final
norm and the LM head; the CPU runs the last ``N`` layers each step.

What :func:`split_model` makes of a model loaded into host memory: the last ``N``
layers' GGUF projections become the CPU path's modules
(:func:`~engine.layers.cpu_pack.pack_linears`: blocks the C GEMV reads, else torch's int4
layout or dequantized), their other weights float32; everything else moves to the device
(and, on the CPU itself, takes the CPU path's modules too). The layers' KV cache is a
host pool of their own (:class:`~engine.kvcache.pool.KVPool` on the CPU, float32 or the
``--kv-cache-dtype``'s blocks), addressed by the same page ids and slots as the device's
pool, so one page allocator, the scheduler and the prefix cache serve both: its page
count follows the device pool's (:meth:`HostLayers.follow`), and a live shrink's page
moves are made in both (:meth:`HostLayers.copy_pages`).

Each step (:meth:`HostLayers.run`) copies the hidden rows and the residual stream of the
step's tokens to the host in float32 (``[T, hidden]`` each), runs the layers (a decode
step through the C decode layer where it runs them, :mod:`engine.layers.cpu_decode`; the
torch layers over the torch attention backend otherwise) and copies the two back in the
model's dtype. The copy reads the device's results, so such a step cannot be captured in
a CUDA graph: a split model decodes eagerly. The plan's profile run
(:func:`engine.core.profile.measure_step_peak`) skips the CPU's layers
(:attr:`HostLayers.device_only`): it measures the device's memory, which they do not use.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from engine.common import progress
from engine.common.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool, kv_storage_dtype
from engine.layers.attention.registry import model_attention
from engine.layers.cpu_decode import CpuDecode
from engine.layers.cpu_pack import pack_linears, pack_model_for_cpu
from engine.layers.linear.cpu_blocks import CpuBlockLinear
from engine.layers.linear.cpu_int4 import CpuInt4Linear
from engine.layers.linear.gguf_blocks import QuantLinear

log = logging.getLogger("headroom.engine")


def host_batch(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with its tensors on the CPU (itself when they are there already); the
    device-side metadata is left for the CPU backend to build."""
    if batch.input_ids.device.type == "cpu":
        return batch
    page_table = batch.page_table_cpu if batch.page_table_cpu is not None else batch.page_table.cpu()
    return ForwardBatch(
        is_decode=batch.is_decode, input_ids=batch.input_ids.cpu(), positions=batch.positions.cpu(),
        out_slots=batch.out_slots.cpu(), page_table=page_table, prefix_lens=batch.prefix_lens,
        extend_lens=batch.extend_lens, logits_indices=batch.logits_indices.cpu(), page_table_cpu=page_table,
        sample_rows=batch.sample_rows, state_slots=batch.state_slots)


class HostLayers:
    """The last decoder layers of a split model, run on the CPU (module docstring).

    Args:
        layers: the layers (the model's own modules, already in their CPU form).
        start: the index of the first of them in the model.
        kv_cache_dtype: ``--kv-cache-dtype`` (``auto`` is float32 here).
        page_size: tokens per page, as the device pool's.
        cos_sin: the float32 RoPE cache on the CPU.
        cpu_decode: the C decode layer over these layers, or None (the torch layers).
        max_batch: the attention backend's batch (``--max-running-requests``).
    """

    def __init__(self, config, layers: list[nn.Module], start: int, *, kv_cache_dtype: str, page_size: int,
                 cos_sin: torch.Tensor, cpu_decode: CpuDecode | None, max_batch: int) -> None:
        self.layers = layers
        self.start = start
        self.cos_sin = cos_sin
        self.cpu_decode = cpu_decode
        dtype = kv_storage_dtype(kv_cache_dtype, torch.float32)
        # Starts at the smallest pool; follow() sizes it to the device pool at each step.
        self.pool = KVPool(num_layers=len(layers), num_pages=2, page_size=page_size,
                           num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype,
                           device="cpu", compute_dtype=torch.float32)
        self.attn = model_attention("torch", self.pool, config, max_batch)
        # The GGUF projections of these layers as the file holds them, by the layer's
        # index in the model (file_form), kept where the boundary may move back up
        # (--cpu-layers auto, engine.layers.split_move); empty otherwise.
        self.file_forms: dict[int, dict[str, nn.Module]] = {}
        # Set inside device_only_steps (measure_step_peak's window): the device's part of a step
        # without the CPU's, which allocates nothing on the device.
        self.device_only = False

    @contextmanager
    def device_only_steps(self) -> Iterator[None]:
        """Inside the block, :meth:`run` skips the layers (:attr:`device_only`): the
        plan's profile run, which measures the device's memory."""
        self.device_only = True
        try:
            yield
        finally:
            self.device_only = False

    def follow(self, num_pages: int, *, written_pages: int | None = None) -> None:
        """Make the host pool ``num_pages`` pages (the device pool's count), keeping the
        pages both hold (those below ``written_pages``, the page allocator's high-water
        mark, where given: :meth:`engine.kvcache.pool.KVPool.resize`); a no-op when it is
        that size already."""
        if self.pool.num_pages != num_pages:
            self.pool.resize(num_pages, written_pages=written_pages)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """The device pool's page moves of a live shrink, made in the host pool too
        (:meth:`engine.kvcache.pool.KVPool.copy_pages`)."""
        self.pool.copy_pages(src, dst)

    def run(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
            num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over one step: ``h`` (the last device layer's MLP output) and
        ``residual``, both
        ``[T, hidden]`` on the device in the model's dtype, to the last layer's
        ``(mlp_output, residual)`` in the same place and dtype. ``num_pages``: the device
        pool's pages (the host pool follows it)."""
        if self.device_only:
            # What a step puts on the device here is the two copies back, made alike;
            # the layers' CPU work (minutes for a long prefill of an 8B's float32
            # layers) changes nothing the profile measures.
            return h.clone(), (h if residual is None else residual).clone()
        self.follow(num_pages)
        device, dtype = h.device, h.dtype
        hb = h.to("cpu", torch.float32, copy=True)
        rb = None if residual is None else residual.to("cpu", torch.float32, copy=True)
        cb = host_batch(batch)
        fast = self.cpu_decode
        if fast is not None and fast.takes(cb, hb, self.pool):
            hb, rb = fast.run(hb, cb, self.pool, self.cos_sin, residual=rb, attn=self.attn)
        else:
            self.attn.prepare(cb)
            for layer in self.layers:
                hb, rb = layer(hb, rb, cb, self.attn, self.cos_sin)
                progress.advance()
        return hb.to(device, dtype), rb.to(device, dtype)


def dense_to(layer: nn.Module, dtype: torch.dtype) -> None:
    """The dense weights of ``layer`` (norms, nn.Linear projections, biases) in ``dtype``
    (float32 as the CPU path holds them, the model's dtype back on the device); the
    packed projections keep their layouts (torch's int4 layout wants its scales in
    bfloat16) and so do the GGUF blocks (uint8)."""
    packed = {id(m) for top in layer.modules() if isinstance(top, CpuBlockLinear | CpuInt4Linear)
              for m in top.modules()}
    for module in layer.modules():
        if id(module) in packed:
            continue
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t is not None and t.is_floating_point() and t.dtype != dtype:
                setattr(module, name, nn.Parameter(t.to(dtype), requires_grad=False) if isinstance(t, nn.Parameter)
                        else t.to(dtype))


def file_form(layer: nn.Module) -> dict[str, nn.Module]:
    """The GGUF projections (QuantLinear, in the file's layout, on the CPU) of ``layer``
    by module name, taken before :func:`~engine.layers.cpu_pack.pack_linears` replaces
    them: what a layer moved back to the device is made of
    (:mod:`engine.layers.split_move`). Blocks the C GEMV reads are shared with the packed
    module (no second copy); other types cost their file bytes again."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, QuantLinear)}


def split_model(model: nn.Module, cpu_layers: int, device: torch.device, lib: ctypes.CDLL | None, *,
                kv_cache_dtype: str, page_size: int, max_batch: int, keep_file_form: bool = False) -> nn.Module:
    """Keep the last ``cpu_layers`` decoder layers of ``model`` (a dense CausalLM loaded
    into host memory) on the CPU and move the rest to ``device`` (module docstring);
    sets ``model.host_layers``. ``lib``: the C CPU kernels, or None (torch's).
    ``keep_file_form``: keep the host layers' GGUF projections as the file holds them
    (:attr:`HostLayers.file_forms`), for a boundary that may move back up.

    Raises:
        ValueError: ``cpu_layers`` outside ``1..num_layers - 1`` (one layer stays on the
            device, as :func:`engine.core.settings_fit.check_cpu_layers` refuses).
    """
    layers = model.model.layers
    if not 1 <= cpu_layers < len(layers):
        raise ValueError(f"--cpu-layers {cpu_layers}: the model has {len(layers)} decoder layers; "
                         f"use 0-{len(layers) - 1}")
    start = len(layers) - cpu_layers
    host = list(layers[start:])
    forms = {}
    for i, layer in enumerate(host, start):
        if keep_file_form:
            forms[i] = file_form(layer)
        pack_linears(layer, torch.float32, lib)
        dense_to(layer, torch.float32)
        layer.self_attn.layer -= start  # its index in the host pool
    cos_sin = model.cos_sin_cache.float().cpu() if model.cos_sin_cache is not None else None
    if device.type == "cpu":
        pack_model_for_cpu(model, model.model.norm.weight.dtype, lib, decode_layers=layers[:start])
    else:
        for part in (model.model.embed_tokens, model.model.norm, model.lm_head, *layers[:start]):
            if part is not None:
                part.to(device)
        model.cos_sin_cache = None  # rebuilt on the device at the first forward
    if cos_sin is None:
        model.init_rope_cache()
        cos_sin = model.cos_sin_cache.float().cpu()
    decode = CpuDecode.build(model, lib, host) if lib is not None else None
    model.host_layers = HostLayers(model.config, host, start, kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                                   cos_sin=cos_sin.contiguous(), cpu_decode=decode, max_batch=max_batch)
    model.host_layers.file_forms = forms
    log.info("decoder layers %d-%d of %d on the CPU (%s), the rest on %s; decode runs eagerly (no CUDA graphs)",
             start, len(layers) - 1, len(layers), "C decode layer" if decode is not None else "torch layers", device)
    return model
