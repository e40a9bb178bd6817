"""Gemma 4's text model (``Gemma4ForCausalLM``, and the language model of
``Gemma4ForConditionalGeneration``), as transformers' ``modeling_gemma4`` computes it.

Gemma 3's layout (:mod:`engine.models.gemma3`: scaled embeddings, four norms a layer,
a GELU-tanh MLP, sliding and global layers with a RoPE each, soft-capped logits), with:

- RMSNorms scaling by ``w`` (not ``1 + w``), computed in float32, and a norm without a
  weight on the values;
- an attention scale of 1 (q and k are normed per head);
- each layer kind its own head size and KV heads (:class:`Gemma4Layout`); the global
  layers' RoPE "proportional": plain RoPE over the whole head whose frequencies past a
  fraction are 0; their values may be their key projection (``keys_as_values``);
- the last ``kv_shared_layers`` layers reading the keys and values of the last earlier
  layer of their kind instead of their own (no k/v projections, no place in the pool),
  with an MLP twice as wide where ``double_wide_mlp``;
- per-layer embeddings: a second embedding table gives each token a small vector per
  layer, mixed with a projection of the embeddings, which each layer gates, projects
  and adds after its MLP;
- each layer's output scaled by its ``layer_scalar``.

The KV pool holds one shape for every layer (the larger head size and KV head count of
the two kinds): a layer's keys, values and queries are padded with zeros to that head
size and its KV heads repeated, and its output cut back (zeros add nothing to a score at
a scale of 1). A vision checkpoint's towers are skipped at load, as for Gemma 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.common import progress
from engine.common.config import ModelConfig
from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend
from engine.layers.rope import build_cos_sin_cache
from engine.models.gemma3 import Gemma3CausalLM
from engine.models.qwen3_next import _rotate

_SLIDING = "sliding_attention"
# A multimodal checkpoint's audio tower and the towers' embedders (beside Gemma 3's vision tower).
_TOWERS = ("model.audio_tower.", "model.embed_audio.", "model.embed_vision.")


class Gemma4RMSNorm(nn.Module):
    """``x / rms(x) * w`` in float32, back in ``x``'s dtype; no ``w`` when not ``scaled``."""

    def __init__(self, dim: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (out if self.weight is None else out * self.weight.float()).type_as(x)


def shares_kv(config: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` reads another layer's keys and values."""
    return layer not in config.kv_layers


def kv_index(config: ModelConfig, layer: int) -> int:
    """The KV pool index ``layer`` reads: its own, or that of the last layer of its kind
    that has keys and values."""
    kinds = config.layer_types
    own = layer if not shares_kv(config, layer) else max(i for i in config.kv_layers if kinds[i] == kinds[layer])
    return config.kv_layers.index(own)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        g = config.gemma4
        assert g is not None
        self.sliding = config.layer_types[layer] == _SLIDING
        self.head_dim = g.sliding_head_dim if self.sliding else g.global_head_dim
        self.num_kv_heads = g.sliding_kv_heads if self.sliding else g.global_kv_heads
        self.num_heads, self.pool_dim, self.pool_heads = config.num_heads, config.head_dim, config.num_kv_heads
        self.kv_index, self.shared = kv_index(config, layer), shares_kv(config, layer)
        h, eps, kv = config.hidden_size, config.rms_norm_eps, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not self.shared:
            self.k_proj = nn.Linear(h, kv, bias=config.attention_bias)
            own_values = self.sliding or not g.keys_as_values
            self.v_proj = nn.Linear(h, kv, bias=config.attention_bias) if own_values else None
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, scaled=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.attention_bias)

    def _pooled(self, x: torch.Tensor, kv: bool) -> torch.Tensor:
        """``x [T, heads, head_dim]`` padded with zeros to the pool's head size, and for
        keys and values (``kv``) their heads repeated to the pool's, contiguous."""
        if kv and self.num_kv_heads != self.pool_heads:
            x = x.repeat_interleave(self.pool_heads // self.num_kv_heads, dim=1)
        return (F.pad(x, (0, self.pool_dim - self.head_dim)) if self.pool_dim != self.head_dim else x).contiguous()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, cos_sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (normed) to the o projection's output; ``cos_sin`` the cache of
        this layer's kind."""
        t, d = x.shape[0], self.head_dim
        cs = cos_sin[batch.positions]
        cos, sin = cs[:, : d // 2], cs[:, d // 2 :]
        q = _rotate(self.q_norm(self.q_proj(x).view(t, self.num_heads, d)), cos, sin, d)
        if not self.shared:
            keys = self.k_proj(x).view(t, self.num_kv_heads, d)
            v = self.v_norm(keys if self.v_proj is None else self.v_proj(x).view(t, self.num_kv_heads, d))
            k = _rotate(self.k_norm(keys), cos, sin, d)
            slots = batch.out_slots_for(self.kv_index in attn.pool.ring_layers)
            attn.pool.store(self.kv_index, slots, self._pooled(k, True), self._pooled(v, True))
        out = attn.attend(self._pooled(q, False), self.kv_index, batch)  # [T, H * pool_dim]
        return self.o_proj(out.view(t, self.num_heads, self.pool_dim)[..., :d].reshape(t, -1))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        g = config.gemma4
        assert g is not None
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer)
        wide = 2 if g.double_wide_mlp and self.self_attn.shared else 1
        self.mlp = Gemma4MLP(h, config.intermediate_size * wide)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        if g.per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(h, g.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(g.per_layer_input_size, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, cos_sin: torch.Tensor,
                per_layer: torch.Tensor | None) -> torch.Tensor:
        """The residual stream ``h [T, hidden]`` through this layer; ``per_layer [T, P]``
        its per-layer inputs (None: the model has none)."""
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), batch, attn, cos_sin))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if per_layer is not None:
            gated = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        g = config.gemma4
        assert g is not None
        h, eps, per_layer = config.hidden_size, config.rms_norm_eps, g.per_layer_input_size
        self.per_layer_size = per_layer
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Gemma4RMSNorm(h, eps)
        if per_layer:
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size, config.num_layers * per_layer)
            self.per_layer_model_projection = nn.Linear(h, config.num_layers * per_layer, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(per_layer, eps)

    def per_layer_inputs(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """``[T, layers, P]``: the token's own per-layer embeddings (scaled by ``sqrt(P)``)
        and the normed projection of its (scaled) embeddings, averaged in energy."""
        t, layers = ids.shape[0], len(self.layers)
        own = self.embed_tokens_per_layer(ids)
        own = (own * torch.tensor(self.per_layer_size**0.5).to(own.dtype)).view(t, layers, -1)
        projected = self.per_layer_model_projection(embedded) * embedded.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(projected.view(t, layers, -1)) + own) * 2.0**-0.5


class Gemma4CausalLM(Gemma3CausalLM):
    """Gemma 4 over the paged KV cache; Gemma 3's life cycle (no tensor parallelism, no
    C decode layer), and its loading of a vision checkpoint's language model.

    Attributes:
        cos_sin_cache: the global layers' ``[max_position_embeddings, global_head_dim]``
            float32 cos/sin (proportional: the frequencies past the turning fraction 0).
        cos_sin_local: the sliding layers' ``[max_position_embeddings, sliding_head_dim]``.
    """

    family_name = "Gemma 4"
    model_class = Gemma4Model
    skipped_prefixes = (*Gemma3CausalLM.skipped_prefixes, *_TOWERS)
    skipped_kind = "vision and audio"

    def use_parallel(self, tp, full_vocab_size: int) -> None:
        """Refused: each layer kind has its own heads and KV heads, and layers share KV,
        which the split does not follow yet.

        Raises:
            ValueError: always, naming the fix.
        """
        raise ValueError(f"{self.family_name} does not run tensor-parallel yet; use --tensor-parallel-size 1")

    def init_rope_cache(self) -> None:
        """Both cos/sin caches, float32, on the model's device."""
        device = self.model.norm.weight.device
        c, g = self.config, self.config.gemma4
        assert g is not None and c.rope_local is not None
        cache = build_cos_sin_cache(c.rope, g.global_head_dim, c.max_position_embeddings, device)
        half, turning = g.global_head_dim // 2, int(g.global_rotary_fraction * g.global_head_dim // 2)
        cache[:, turning:half], cache[:, half + turning :] = 1.0, 0.0  # cos 1, sin 0: not turned
        self.cos_sin_cache = cache
        self.cos_sin_local = build_cos_sin_cache(c.rope_local, g.sliding_head_dim, c.max_position_embeddings, device)

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The embeddings ``h [T, hidden]`` through every layer, with its kind's RoPE and
        its per-layer inputs."""
        m = self.model
        per_layer = m.per_layer_inputs(batch.input_ids, h) if m.per_layer_size else None
        for i, layer in enumerate(m.layers):
            cos_sin = self.cos_sin_local if layer.self_attn.sliding else self.cos_sin_cache
            h = layer(h, batch, attn, cos_sin, None if per_layer is None else per_layer[:, i])
            progress.advance()
        return h

    @staticmethod
    def _target(hf_name: str) -> tuple[str, None]:
        """Every tensor into the parameter of its own name: nothing here is fused."""
        return hf_name, None
