"""A CPU decode step's layers through the C decode layer (:mod:`kernels.cpu.decode_layer`):
one call a layer instead of some sixty torch ops.

Taken by :meth:`engine.models.decoder.CausalLM.forward` for decode steps (one new token a
row) of a float32 model whose every layer it can run: a Llama/Qwen2/Qwen3-family layer
(no whole-projection q/k norm, no q/k/v clipping, no o bias) whose projections are
each up to three runs of GGUF blocks the C GEMV reads
(:class:`~engine.layers.linear.cpu_blocks.CpuBlockLinear`; Q4_0/Q4_1/Q8_0 and the
K-quants, mixed as a Q4_K_M file's q/k/v mix them), over a float32 KV pool or
one of llama.cpp's q8_0/q4_0 blocks (``--kv-cache-dtype q8_0``, ``q4_0``).
A mixture-of-experts layer (Qwen2-MoE, Qwen3-MoE, Mixtral) runs its attention half there,
up to the post-attention norm, and then its
:class:`~engine.layers.moe.sparse_moe.SparseMoeBlock` on the normed rows: the router and
top-k in torch, the routed experts in one call of the C kernels
(:func:`kernels.cpu.moe_experts.moe_experts`), a shared expert as the block runs it; the
dense layers among them (``mlp_only_layers``) run whole in the C layer.
A prefill or extend step runs each layer's two halves in C around the attention
backend's attention (torch's sdpa over the pool): the norms, rotary, the KV store and
SiLU in C where torch took some forty ops a layer. Every other model (Gemma 3's
sliding-window, GELU and four-norm layers among them) keeps the torch layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from engine.common import progress
from engine.layers.linear.cpu_blocks import CpuBlockLinear
from engine.layers.moe.sparse_moe import SparseMoeBlock
from kernels.cpu import decode_layer


def _runs(proj: nn.Module) -> list[tuple[torch.Tensor, str]] | None:
    """``[(blocks, type)]`` of a projection that is a few runs of C-read blocks, else None."""
    if not isinstance(proj, CpuBlockLinear) or not 1 <= len(proj.types) <= decode_layer.PROJ_PARTS:
        return None
    if any(t not in decode_layer.TYPES for t in proj.types):
        return None
    return [(proj.part(i), t) for i, t in enumerate(proj.types)]


def _declines(model: nn.Module, layers) -> bool:
    """Whether the model's family or form is one the C layer does not run (module docstring)."""
    config = model.config
    if config.is_hybrid or config.qk_norm_whole or config.clip_qkv is not None or config.head_dim % 2:
        return True
    if config.windowed_attention or config.hidden_act != "silu":  # Gemma 3's layers are not the C layer's
        return True
    return (getattr(model, "tp", None) is not None or not len(layers)
            or layers[0].input_layernorm.weight.dtype != torch.float32)


def _attention(layer: nn.Module, config) -> list | None:
    """The runs of ``layer``'s q/k/v and o projections, or None where the C layer cannot
    read them or they are not the shapes its scratch assumes."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(attn, "qkv_proj") or attn.o_proj.bias is not None:
        return None
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    if (attn.qkv_proj.out_features, attn.qkv_proj.in_features) != (q + 2 * kv, h) \
            or (attn.o_proj.out_features, attn.o_proj.in_features) != (h, q):
        return None
    projs = [_runs(attn.qkv_proj), _runs(attn.o_proj)]
    return None if any(p is None for p in projs) else projs


def _dense_mlp(mlp: nn.Module, config) -> list | None:
    """The runs of a dense MLP's gate/up and down projections, or None (as :func:`_attention`)."""
    if not hasattr(mlp, "gate_up_proj") or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return None
    h, inter = config.hidden_size, config.intermediate_size
    if (mlp.gate_up_proj.out_features, mlp.gate_up_proj.in_features) != (2 * inter, h) \
            or (mlp.down_proj.out_features, mlp.down_proj.in_features) != (h, inter):
        return None
    projs = [_runs(mlp.gate_up_proj), _runs(mlp.down_proj)]
    return None if any(p is None for p in projs) else projs


# The scratch kept between steps: a decode step's (a few rows) and a short prefill's stay;
# a long prefill's (an 8B model's 2,048-token chunk: some 380 MiB, mostly gate/up) is
# freed after its step, so resident memory after it is what it was before.
KEEP_SCRATCH_BYTES = 64 << 20


@dataclass
class CpuDecode:
    """The C specs of a model's layers (built once; the tensors they point to are the
    model's own, kept alive by it). ``moe[i]``: layer ``i``'s mixture-of-experts block,
    which runs (in torch, its experts by the C kernels) on the rows the C layer hands
    back, or None where the C layer runs the layer's dense MLP itself."""

    lib: ctypes.CDLL
    specs: list[decode_layer.Layer]
    keep: list[torch.Tensor]  # the contiguous float32 copies the specs point to
    scratch: torch.Tensor
    moe: list[nn.Module | None] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, lib: ctypes.CDLL, layers=None) -> CpuDecode | None:
        """The decode path for ``model``'s ``layers`` (all of them by default; with a
        split, :mod:`engine.layers.host_layers`, those on the CPU) once packed for the CPU
        (:func:`~engine.layers.cpu_pack.pack_model_for_cpu`), or None where a
        layer is not one it runs (module docstring)."""
        config = model.config
        layers = model.model.layers if layers is None else layers
        if _declines(model, layers):
            return None
        specs, keep, moe = [], [], []

        def f32(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t

        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            experts = isinstance(mlp, SparseMoeBlock)
            projs, dense = _attention(layer, config), None if experts else _dense_mlp(mlp, config)
            if projs is None or (not experts and dense is None):
                return None
            head_norm = attn.q_norm is not None
            specs.append(decode_layer.layer(
                hidden=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim, intermediate=0 if experts else config.intermediate_size,
                eps=layer.input_layernorm.eps, scale=config.head_dim ** -0.5,
                input_norm=f32(layer.input_layernorm.weight), post_norm=f32(layer.post_attention_layernorm.weight),
                q_norm=f32(attn.q_norm.weight) if head_norm else None,
                k_norm=f32(attn.k_norm.weight) if head_norm else None,
                qkv_bias=f32(attn.qkv_proj.bias),
                qkv=decode_layer.proj(projs[0]), o=decode_layer.proj(projs[1]),
                gate_up=None if experts else decode_layer.proj(dense[0]),
                down=None if experts else decode_layer.proj(dense[1])))
            moe.append(mlp if experts else None)
            if head_norm and attn.q_norm.eps != layer.input_layernorm.eps:
                return None  # the C layer takes one eps for every norm
        if not specs:
            return None
        return cls(lib, specs, keep, torch.empty(0, dtype=torch.uint8), moe)

    @cached_property
    def widest(self) -> decode_layer.Layer:
        """The spec whose scratch is the largest: a dense layer's MLP, if any (an MoE
        layer's spec stops before its MLP); found once, not on every step."""
        return max(self.specs, key=lambda spec: spec.intermediate)

    def takes(self, batch, h: torch.Tensor, pool) -> bool:
        """Whether this step runs here: float32 rows over a pool the C layer reads
        (float32, float16, q8_0/q4_0 blocks), its index tensors int64; a decode step
        whole, any other step around the attention backend's attention."""
        indices = (batch.positions, batch.out_slots, batch.page_table, batch.prefix_lens, batch.extend_lens)
        return (h.dtype == torch.float32 and pool.dtype in decode_layer.KV_TYPE_IDS
                and all(t.dtype == torch.int64 and t.device.type == "cpu" for t in indices))

    def run(self, h: torch.Tensor, batch, pool, cos_sin: torch.Tensor,
            residual: torch.Tensor | None = None, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers of a step: ``h`` the embeddings ``[T, hidden]`` float32 (or, with
        ``residual``, an earlier layer's MLP output and the residual stream before it, as
        the torch layers pass them on) to ``(mlp_output, residual)`` as the torch layers
        return them (the final norm adds the two). A decode step runs each layer in one C
        call; a prefill or extend step runs each layer's two halves in C
        (:func:`~kernels.cpu.decode_layer.run_in`, :func:`~kernels.cpu.decode_layer.run_out`)
        around ``attn``'s attention (the model's backend over ``pool``, needed then)."""
        h = h.contiguous().clone()
        first = residual is None
        residual = torch.empty_like(h) if first else residual.contiguous().clone()
        seq_lens = batch.seq_lens.contiguous()
        decode = batch.is_decode
        if not decode and attn is None:
            raise ValueError("a prefill or extend step on the C layer needs the attention backend")
        max_len = int(seq_lens.max()) if seq_lens.numel() and decode else 0
        need = decode_layer.scratch_bytes(self.lib, self.widest, h.shape[0], max_len)
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
        if not decode:
            attn.prepare(batch)
        for i, spec in enumerate(self.specs):
            if decode:
                decode_layer.run(self.lib, spec, st, h, residual, pool.k_buffers[i], pool.v_buffers[i], self.scratch,
                                 max_len, first=first and i == 0)
            else:
                q, _, _ = decode_layer.run_in(self.lib, spec, st, h, residual, pool.k_buffers[i], pool.v_buffers[i],
                                              self.scratch, first=first and i == 0)
                out = attn.attend(q, i, batch)  # the keys and values just stored, and the prefix's
                decode_layer.run_out(self.lib, spec, st, out.contiguous(), h, residual, self.scratch)
            if self.moe[i] is not None:  # h: the post-attention norm's rows, the experts' input
                h = self.moe[i](h).float().contiguous()
            progress.advance()
        if self.scratch.numel() > KEEP_SCRATCH_BYTES:  # a long prefill's: returned, as torch's temporaries are
            self.scratch = torch.empty(0, dtype=torch.uint8)
        return h, residual
