"""A CPU decode step's layers through the C decode layer (:mod:`kernels.cpu.decode_layer`):
one call a layer instead of some sixty torch ops.

Taken by :meth:`engine.models.decoder.CausalLM.forward` for decode steps (one new token a
row) of a float32 model whose every layer it can run: a dense Llama/Qwen2/Qwen3-family
layer (no mixture of experts, no whole-projection q/k norm, no q/k/v clipping, no o
bias) whose four projections are each up to three runs of GGUF blocks the C GEMV reads
(:class:`~engine.layers.linear.cpu_blocks.CpuBlockLinear`; Q4_0/Q4_1/Q8_0 and the
K-quants, mixed as a Q4_K_M file's q/k/v mix them), over a float32 KV pool or
one of llama.cpp's q8_0/q4_0 blocks (``--kv-cache-dtype q8_0``, ``q4_0``).
Prefill and extend steps, and every other model (Gemma 3's sliding-window, GELU and
four-norm layers among them), keep the torch layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from engine.common import progress
from engine.layers.linear.cpu_blocks import CpuBlockLinear
from kernels.attention.kv_store import block_format
from kernels.cpu import decode_layer


def _runs(proj: nn.Module) -> list[tuple[torch.Tensor, str]] | None:
    """``[(blocks, type)]`` of a projection that is a few runs of C-read blocks, else None."""
    if not isinstance(proj, CpuBlockLinear) or not 1 <= len(proj.types) <= decode_layer.PROJ_PARTS:
        return None
    if any(t not in decode_layer.TYPES for t in proj.types):
        return None
    return [(proj.part(i), t) for i, t in enumerate(proj.types)]


@dataclass
class CpuDecode:
    """The C specs of a model's layers (built once; the tensors they point to are the
    model's own, kept alive by it)."""

    lib: ctypes.CDLL
    specs: list[decode_layer.Layer]
    keep: list[torch.Tensor]  # the contiguous float32 copies the specs point to
    scratch: torch.Tensor

    @classmethod
    def build(cls, model: nn.Module, lib: ctypes.CDLL, layers=None) -> CpuDecode | None:
        """The decode path for ``model``'s ``layers`` (all of them by default; with a
        split, :mod:`engine.layers.host_layers`, those on the CPU) once packed for the CPU
        (:func:`~engine.layers.cpu_pack.pack_model_for_cpu`), or None where a
        layer is not one it runs (module docstring)."""
        config = model.config
        layers = model.model.layers if layers is None else layers
        if (config.is_hybrid or config.moe_layers or config.qk_norm_whole or config.clip_qkv is not None
                or config.head_dim % 2):
            return None
        if config.windowed_attention or config.hidden_act != "silu":  # Gemma 3's layers are not the C layer's
            return None
        if getattr(model, "tp", None) is not None or not len(layers) \
                or layers[0].input_layernorm.weight.dtype != torch.float32:
            return None
        specs, keep = [], []

        def f32(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t

        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not hasattr(mlp, "gate_up_proj") or not hasattr(attn, "qkv_proj"):
                return None
            projs = [_runs(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in projs) or attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None \
                    or mlp.down_proj.bias is not None:
                return None
            # The C layer sizes its scratch from the config: each projection must be the
            # shape it assumes (rows x K), or it would write past it.
            h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
            shapes = [(attn.qkv_proj, q + 2 * kv, h), (attn.o_proj, h, q), (mlp.gate_up_proj, 2 * inter, h),
                      (mlp.down_proj, h, inter)]
            if any((p.out_features, p.in_features) != (rows, k) for p, rows, k in shapes):
                return None
            head_norm = attn.q_norm is not None
            specs.append(decode_layer.layer(
                hidden=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim, intermediate=config.intermediate_size,
                eps=layer.input_layernorm.eps, scale=config.head_dim ** -0.5,
                input_norm=f32(layer.input_layernorm.weight), post_norm=f32(layer.post_attention_layernorm.weight),
                q_norm=f32(attn.q_norm.weight) if head_norm else None,
                k_norm=f32(attn.k_norm.weight) if head_norm else None,
                qkv_bias=f32(attn.qkv_proj.bias),
                qkv=decode_layer.proj(projs[0]), o=decode_layer.proj(projs[1]),
                gate_up=decode_layer.proj(projs[2]), down=decode_layer.proj(projs[3])))
            if head_norm and attn.q_norm.eps != layer.input_layernorm.eps:
                return None  # the C layer takes one eps for every norm
        if not specs:
            return None
        return cls(lib, specs, keep, torch.empty(0, dtype=torch.uint8))

    def takes(self, batch, h: torch.Tensor, pool) -> bool:
        """Whether this step runs here: a decode step of float32 rows over a float32 pool
        or one of q8_0/q4_0 blocks, its index tensors int64 (what the C layer reads)."""
        indices = (batch.positions, batch.out_slots, batch.page_table, batch.prefix_lens, batch.extend_lens)
        kv_ok = pool.dtype == torch.float32 or block_format(pool.dtype) is not None
        return (batch.is_decode and h.dtype == torch.float32 and kv_ok
                and all(t.dtype == torch.int64 and t.device.type == "cpu" for t in indices))

    def run(self, h: torch.Tensor, batch, pool, cos_sin: torch.Tensor,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers of a decode step: ``h`` the embeddings ``[B, hidden]`` float32 (or,
        with ``residual``, an earlier layer's MLP output and the residual stream before
        it, as the torch layers pass them on) to ``(mlp_output, residual)`` as the torch
        layers return them (the final norm adds the two)."""
        h = h.contiguous().clone()
        first = residual is None
        residual = torch.empty_like(h) if first else residual.contiguous().clone()
        seq_lens = batch.seq_lens.contiguous()
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        need = decode_layer.scratch_bytes(self.lib, self.specs[0], h.shape[0], max_len)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.uint8)
        positions, out_slots = batch.positions.contiguous(), batch.out_slots.contiguous()
        page_table = batch.page_table.contiguous()
        # The C layer indexes without bounds checks: what torch's indexing would refuse is
        # refused here (the scheduler never makes such a step).
        slots = pool.k_buffers[0].shape[0]
        if h.shape[0]:
            limits = ((positions, cos_sin.shape[0]), (out_slots, slots), (page_table, slots // pool.page_size))
            if any(int(low) < 0 or int(high) >= bound for t, bound in limits for low, high in [torch.aminmax(t)]):
                raise IndexError(f"decode step out of range: positions below {cos_sin.shape[0]}, slots below {slots}")
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
            raise ValueError(f"cos/sin cache {cos_sin.dtype}, contiguous {cos_sin.is_contiguous()}: float32 wanted")
        st = decode_layer.step(positions=positions, out_slots=out_slots, seq_lens=seq_lens, page_table=page_table,
                               page_size=pool.page_size, cos_sin=cos_sin, threads=torch.get_num_threads())
        for i, spec in enumerate(self.specs):
            decode_layer.run(self.lib, spec, st, h, residual, pool.k_buffers[i], pool.v_buffers[i], self.scratch,
                             max_len, first=first and i == 0)
            progress.advance()
        return h, residual
