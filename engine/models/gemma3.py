"""Gemma 3's text model (``Gemma3ForCausalLM``, and the language model of
``Gemma3ForConditionalGeneration``), as transformers' ``modeling_gemma3`` computes it.

It differs from the Llama layout of :mod:`engine.models.decoder` in:

- the embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the embeddings'
  dtype first (``Gemma3TextScaledWordEmbedding``);
- every RMSNorm scaling by ``1 + w`` in float32 (the trunk's and the per-head q/k norms):
  :class:`~engine.models.qwen3_next.ZeroCenteredRMSNorm`;
- four norms a layer: after attention and after the MLP too, each before its residual add;
- a GELU (tanh approximation) gate in the MLP;
- ``"sliding_attention"`` layers that see only the last ``sliding_window`` tokens and
  rotate with their own base (``rope_local``), between ``"full_attention"`` layers over
  the whole context (``rope``, with its scaling);
- the attention scale ``query_pre_attn_scalar ** -0.5``, and optional soft-capping of the
  logits (``c * tanh(x / c)``; the config's attention cap is Gemma 2's, which Gemma 3's
  attention does not apply: :func:`engine.loader.hf_config._gemma3_fields`).

The window (and a score cap, for a family that has one) are the attention backend's
(:meth:`~engine.layers.attention.base.AttentionBackend.use_windows`, set from
:attr:`ModelConfig.kv_windows`). A vision checkpoint's tower and projector are skipped at
load (text only), its language model's names mapped onto this model's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.common import progress
from engine.common.config import ModelConfig
from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend
from engine.layers.rope import build_cos_sin_cache
from engine.models.decoder import CausalLM, project
from engine.models.qwen3_next import ZeroCenteredRMSNorm as GemmaRMSNorm
from engine.models.qwen3_next import rotate_and_store

log = logging.getLogger("headroom.engine")

# A multimodal checkpoint's language model, under transformers 5's names and the older
# ones, -> ours; what sits under the skipped prefixes is the vision side.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.sliding = config.layer_types[layer] == "sliding_attention"
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, cos_sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (normed) to the o projection's output; ``cos_sin`` the cache of
        this layer's kind (local or global)."""
        t = x.shape[0]
        q, k, v = project(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = rotate_and_store(q, k, v, cos_sin, self.head_dim, batch, attn, self.layer)
        return project(self.o_proj, attn.forward(q, k, v, self.layer, batch, kv_stored=True))


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x).chunk(2, dim=-1)
        return project(self.down_proj, F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(config, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(h, config.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        # Set by Gemma3CausalLM.use_parallel: o and down are row-parallel, their partial
        # products summed over the ranks before the norm after each.
        self.tp = None

    def forward(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                cos_sin: torch.Tensor) -> torch.Tensor:
        """The residual stream ``h [T, hidden]`` through this layer."""
        a = self.self_attn(self.input_layernorm(h), batch, attn, cos_sin)
        h = h + self.post_attention_layernorm(a if self.tp is None else self.tp.all_reduce(a))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m if self.tp is None else self.tp.all_reduce(m))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3CausalLM(CausalLM):
    """Gemma 3 over the paged KV cache; same life cycle as :class:`CausalLM`, tensor
    parallelism included (:meth:`use_parallel`); no C decode layer (its layers are not the
    Llama layout it runs).

    Attributes:
        cos_sin_cache: the global layers' ``[max_position_embeddings, head_dim]`` float32
            cos/sin (``rope``, scaled).
        cos_sin_local: the sliding layers' (``rope_local``), the same shape; None until
            :meth:`init_rope_cache`.
    """

    family_name = "Gemma 3"
    model_class: type[nn.Module] = GemmaModel
    # A multimodal checkpoint's tensors that are not its language model's, and what they are.
    skipped_prefixes: tuple[str, ...] = _VISION_PREFIXES
    skipped_kind = "vision"

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", None, persistent=False)
        self.register_buffer("cos_sin_local", None, persistent=False)
        self.tp, self.full_vocab_size, self.cpu_decode = None, config.vocab_size, None

    def use_parallel(self, tp, full_vocab_size: int) -> None:
        """Run as one rank of ``tp`` (:meth:`CausalLM.use_parallel`): the embeddings looked
        up vocab-parallel, an all-reduce after o and down (before the norms that follow
        them), the logits gathered over all ``full_vocab_size`` tokens before their cap."""
        self.tp, self.full_vocab_size = tp, full_vocab_size
        for layer in self.model.layers:
            layer.tp = tp

    def init_rope_cache(self) -> None:
        """Both cos/sin caches, float32, on the model's device."""
        device = self.model.norm.weight.device
        c = self.config
        self.cos_sin_cache = build_cos_sin_cache(c.rope, c.head_dim, c.max_position_embeddings, device)
        self.cos_sin_local = build_cos_sin_cache(c.rope_local or c.rope, c.head_dim, c.max_position_embeddings, device)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """As :meth:`CausalLM.forward`: ``[B, vocab_size]`` float32 logits at
        ``batch.logits_indices``, soft-capped where the config says so."""
        if self.cos_sin_cache is None:
            self.init_rope_cache()
        attn.prepare(batch)
        embed = self.model.embed_tokens
        if self.tp is None:
            h = embed(batch.input_ids)  # [T, hidden]; embeddings in GGUF blocks (CPU) give the model dtype
        else:
            h = self.tp.embed(embed.weight, batch.input_ids, self.full_vocab_size)
        h = h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype)  # rounded to it, as transformers does
        h = self.run_layers(h, batch, attn)
        h = self.model.norm(h[batch.logits_indices])
        logits = (F.linear(h, embed.weight) if self.lm_head is None else self.lm_head(h)).float()
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.full_vocab_size)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The embeddings ``h [T, hidden]`` through every layer, each with its kind's RoPE."""
        for layer in self.model.layers:
            h = layer(h, batch, attn, self.cos_sin_local if layer.self_attn.sliding else self.cos_sin_cache)
            progress.advance()
        return h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`CausalLM.load_weights` of the language model: a multimodal checkpoint's
        text tensors renamed to ours, its vision tensors skipped (counted in the log)."""
        skipped = [0]

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(self.skipped_prefixes):
                    skipped[0] += 1
                    continue
                for prefix, ours in _TEXT_PREFIXES:
                    if name.startswith(prefix):
                        name = ours + name[len(prefix):]
                        break
                yield name, tensor

        super().load_weights(text_only())
        if skipped[0]:
            log.info("%s: text only; %d %s tensors of the checkpoint skipped", self.family_name, skipped[0],
                     self.skipped_kind)
