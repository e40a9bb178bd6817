"""Qwen3-Next: a hybrid of Gated DeltaNet layers (:mod:`engine.layers.gated_deltanet`)
and gated full-attention layers, with MoE (routed experts plus a shared expert behind a
sigmoid gate: :class:`engine.layers.moe.sparse_moe.SparseMoeBlock`) or dense MLPs, as
``Qwen3NextForCausalLM`` in transformers.

Its full-attention layers differ from Qwen3's: ``q_proj`` gives each head a query and a
gate (``[q | gate]`` per head); the attention output is multiplied by ``sigmoid(gate)``
before ``o_proj``; RoPE turns only the first ``rotary_dim`` dims of each head. Every
RMSNorm of the trunk (and the q/k norms) stores ``w - 1`` and scales by ``1 + w``.

Only the full-attention layers have a KV cache: the ``j``-th of them uses layer ``j`` of
the KV pool (``ModelConfig.kv_layers``). The linear layers read and write the
per-request states of :class:`engine.kvcache.state_pool.StatePool`, bound with
:meth:`HybridCausalLM.bind_states` before the first step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.common import progress
from engine.common.config import ModelConfig
from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.moe.sparse_moe import SparseMoeBlock
from engine.layers.rope import build_cos_sin_cache
from engine.models.decoder import MLP, CausalLM, project
from engine.models.hf_weights import Shard


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight`` in float32, then cast (``Qwen3NextRMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place), then the norm of it: ``(normed, residual)``."""
        residual.add_(x)
        return self(residual), residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """RoPE (rotate-half layout) on the first ``rotary_dim`` dims of ``x [T, H, D]``;
    ``cos``, ``sin`` ``[T, rotary_dim // 2]`` float32."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half].float(), x[..., half:rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos[:, None], sin[:, None]
    turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([turned, rest], dim=-1)


def rotate_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
    batch: ForwardBatch, attn: AttentionBackend, layer: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``batch.positions`` (the first
    ``rotary_dim`` dims of each head; ``cos_sin`` the ``[positions, rotary_dim]``
    cache), then ``k`` and ``v [T, Hkv, D]`` stored in ``attn``'s pool at its layer
    ``layer``. Returns the rotated ``q`` and ``k``, contiguous."""
    cs = cos_sin[batch.positions]
    cos, sin = cs[:, : rotary_dim // 2], cs[:, rotary_dim // 2 :]
    q = _rotate(q, cos, sin, rotary_dim).contiguous()
    k = _rotate(k, cos, sin, rotary_dim).contiguous()
    attn.pool.store(layer, batch.out_slots_for(layer in attn.pool.ring_layers), k, v)
    return q, k


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.rotary_dim = config.rotary_dim or config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, cos_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q_gate, k, v = project(self.qkv_proj, x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = rotate_and_store(q, k, v, cos_sin, self.rotary_dim, batch, attn, self.kv_index)
        out = attn.forward(q, k, v, self.kv_index, batch, kv_stored=True)  # [T, Hq * D]
        return project(self.o_proj, out * torch.sigmoid(gate.reshape(t, self.q_size)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, linear_attention: type[GatedDeltaNet]) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        if config.layer_types[layer] == "linear_attention":
            self.linear_attn = linear_attention(config, config.linear_layers.index(layer))
            self.self_attn = None
        else:
            self.self_attn = GatedAttention(config, config.kv_layers.index(layer))
            self.linear_attn = None
        self.mlp = (
            SparseMoeBlock(config, MLP) if layer in config.moe_layers
            else MLP(config.hidden_size, config.intermediate_size)
        )

    def forward(self, h, residual, batch, attn, cos_sin, states):
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        if self.linear_attn is not None:
            h = self.linear_attn(x, batch, states)
        else:
            h = self.self_attn(x, batch, attn, cos_sin)
        x, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(x), residual


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, linear_attention: type[GatedDeltaNet]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i, linear_attention) for i in range(config.num_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridCausalLM(CausalLM):
    """Qwen3-Next over the paged KV cache (full-attention layers) and the state pool
    (linear layers). Same life cycle as :class:`CausalLM`, plus :meth:`bind_states`.
    A family whose linear layers project otherwise names its layer in
    :attr:`linear_attention` (:mod:`engine.models.qwen3_5`)."""

    linear_attention: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = HybridModel(config, self.linear_attention)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", None, persistent=False)
        self.states = None

    def bind_states(self, states) -> None:
        """Use ``states`` (a :class:`engine.kvcache.state_pool.StatePool`) from now on."""
        self.states = states

    def init_rope_cache(self) -> None:
        """``[max_position_embeddings, rotary_dim]`` float32 cos/sin (partial rotary)."""
        device = self.model.norm.weight.device  # the embeddings may be blocks (CPU GGUF)
        self.cos_sin_cache = build_cos_sin_cache(
            self.config.rope, self.config.rotary_dim or self.config.head_dim,
            self.config.max_position_embeddings, device,
        )

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """As :meth:`CausalLM.forward`; ``batch.state_slots`` (or, in a captured decode
        graph, ``batch.state_slots_device``) names each sequence's slot.

        Raises:
            RuntimeError: no state pool bound, or the batch has no state slots.
        """
        if self.states is None or (batch.state_slots is None and batch.state_slots_device is None):
            raise RuntimeError("a hybrid model steps with a bound state pool and batch.state_slots")
        if self.cos_sin_cache is None:
            self.init_rope_cache()
        attn.prepare(batch)
        h = self.model.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, batch, attn, self.cos_sin_cache, self.states)
            progress.advance()
        rows = batch.logits_indices
        h, _ = self.model.norm.add_forward(h[rows], residual[rows])
        if self.lm_head is None:
            return F.linear(h, self.model.embed_tokens.weight).float()
        return self.lm_head(h).float()

    def _shard_view(self, param: torch.Tensor, shard: Shard) -> torch.Tensor:
        """q/k/v shards of the fused projection: q is twice as wide (query and gate)."""
        if shard in ("q", "k", "v"):
            q2, kv = 2 * self.config.q_size, self.config.kv_size
            start, size = {"q": (0, q2), "k": (q2, kv), "v": (q2 + kv, kv)}[shard]
            return param.narrow(0, start, size)
        return super()._shard_view(param, shard)
