"""One decoder-only transformer for Llama, Qwen2 and Qwen3, and their mixture-of-experts
kin (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE).

They differ only in what :class:`ModelConfig` records: Qwen2 has a bias on the
q/k/v projections (``attention_bias``), Qwen3 normalizes each query and key head with
RMSNorm before RoPE (``qk_norm``) and may decouple ``head_dim`` from
``hidden_size // num_heads``; any of them may tie the LM head to the embeddings. OLMoE
normalizes the whole query and key projections instead (``qk_norm_whole``) and may clamp
q/k/v (``clip_qkv``). The layers of ``moe_layers`` swap the MLP for
:class:`engine.layers.moe.sparse_moe.SparseMoeBlock`, whose experts :meth:`CausalLM.load_weights`
stacks from the checkpoint's per-expert tensors.

q/k/v are one fused linear and gate/up another: fewer, larger matmuls, hence fewer kernel
launches per layer. :meth:`CausalLM.load_weights` fuses Hugging Face's separate tensors
at load time.

The elementwise work goes through :mod:`kernels.dispatch` (Triton on CUDA, the torch
references elsewhere) in fused form: the residual add with the next RMSNorm, Qwen3's
q/k norm with rotary and the KV-cache store (the model writes the pool, then calls the
attention backend with ``kv_stored=True``), SiLU with the gate multiply, and, with the ``gemv`` switch on (``--gemv``), the projections of decode
steps of a few tokens (matrix-vector kernels; the gate/up one applies SiLU-and-mul as it
writes; :mod:`kernels.gemv.triton_kernel`). Before GGUF-block projections whose decode GEMV
reads int8 activations, the norm or SiLU-and-mul that writes their input quantizes it
in the same launch (:func:`wants_int8`; ``--no-quant-int8-producer``: a launch of
the projection's own). The forward
reads no value back to the host, so a decode step can be captured in a CUDA graph.

Under tensor parallelism (:mod:`engine.parallel`) each rank builds the decoder at its
shard's shapes; :meth:`CausalLM.use_parallel` adds the collectives: an all-reduce after
o and down, the vocab-parallel embedding lookup, the LM head's logits gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.common import progress
from engine.common.config import ModelConfig
from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend
from engine.layers.linear.gguf_blocks import QuantLinear
from engine.layers.moe.sparse_moe import SparseMoeBlock
from engine.layers.rope import build_cos_sin_cache
from engine.models.hf_weights import HFWeightLoading
from engine.parallel.group import TensorParallel
from kernels.dispatch import (
    fused_add_rms_norm,
    gate_up_silu,
    linear,
    rms_norm,
    rotary_and_store,
    silu_and_mul,
)

# Qwen2's bias covers q/k/v only; Llama's and Qwen3's ``attention_bias`` covers o_proj too
# (``LlamaAttention`` / ``Qwen3Attention`` in transformers).
_O_PROJ_BIAS_FOLLOWS_QKV = {"Qwen2ForCausalLM": False, "Qwen2MoeForCausalLM": False}

def project(proj: nn.Module, x: torch.Tensor, q8=None) -> torch.Tensor:
    """``proj(x)``: a bias-free ``nn.Linear`` through the decode GEMV dispatch
    (:data:`kernels.dispatch.linear`); one with a bias, or a GGUF-block
    :class:`~engine.layers.linear.gguf_blocks.QuantLinear` (no ``weight``), as itself.
    ``q8``: ``x``'s rows quantized for the int8 GEMV by the kernel that wrote ``x`` (given
    only where :func:`wants_int8` said so), which the ``QuantLinear`` then reads instead
    of quantizing ``x`` in a launch of its own."""
    if q8 is not None:
        return proj(x, q8=q8)
    if isinstance(proj, nn.Linear) and proj.bias is None:
        return linear(x, proj.weight)
    return proj(x)


def wants_int8(proj: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether the kernel that writes ``proj``'s input should write it quantized for the
    int8 GEMV too (:meth:`~engine.layers.linear.gguf_blocks.QuantLinear.wants_int8`; never for
    other modules or None). ``x``: that input, or the producer's, of the same rows."""
    return isinstance(proj, QuantLinear) and proj.wants_int8(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place), then the norm of it: ``(normed, residual)``."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_for(self, x: torch.Tensor, proj: nn.Module | None) -> tuple[torch.Tensor, object]:
        """The norm of ``x`` as the input of ``proj``: ``(normed, q8)``, ``q8`` the normed
        rows quantized for ``proj``'s int8 GEMV in the same launch where it takes them
        (:func:`wants_int8`), else None."""
        if wants_int8(proj, x):
            return rms_norm(x, self.weight, self.eps, quantize=True)
        return rms_norm(x, self.weight, self.eps), None

    def add_forward_for(
        self, x: torch.Tensor, residual: torch.Tensor, proj: nn.Module | None
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """:meth:`add_forward` as the input of ``proj``: ``(normed, residual, q8)``, ``q8``
        as :meth:`forward_for`'s."""
        if wants_int8(proj, x):
            return fused_add_rms_norm(x, residual, self.weight, self.eps, quantize=True)
        return *fused_add_rms_norm(x, residual, self.weight, self.eps), None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        o_bias = config.attention_bias and _O_PROJ_BIAS_FOLLOWS_QKV.get(config.architecture, True)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        # Qwen3 normalizes each head (fused with rotary below); OLMoE the whole
        # projections before the heads are split (OlmoeAttention), under the same names.
        self.qk_norm_whole = config.qk_norm_whole
        q_width, k_width = (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
        has_norm = config.qk_norm or config.qk_norm_whole
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps) if has_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps) if has_norm else None
        self.clip_qkv = config.clip_qkv
        # gpt-oss: a logit per head in each softmax's denominator (the backend's ``sinks``).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin_cache: torch.Tensor,
        q8=None,
    ) -> torch.Tensor:
        """``x [T, hidden]`` (normed) to the o projection's output ``[T, hidden]``; ``q8``:
        ``x`` quantized for the q/k/v projection by the norm (:func:`project`)."""
        num_tokens = x.shape[0]
        qkv = project(self.qkv_proj, x, q8)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        pool = attn.pool
        head_norm = self.q_norm is not None and not self.qk_norm_whole
        q = rotary_and_store(
            q, k, v, batch.positions, cos_sin_cache,
            pool.k_buffers[self.layer], pool.v_buffers[self.layer], batch.out_slots_for(self.layer in pool.ring_layers),
            self.q_norm.weight if head_norm else None,
            self.k_norm.weight if head_norm else None,
            self.q_norm.eps if head_norm else 0.0,
        )
        if self.sinks is not None:
            return project(self.o_proj, attn.forward(q, k, v, self.layer, batch, kv_stored=True, sinks=self.sinks))
        if wants_int8(self.o_proj, x):  # the attention kernel may write o's int8 rows too
            out, o_q8 = attn.forward(q, k, v, self.layer, batch, kv_stored=True, quantize=True)
            return project(self.o_proj, out, o_q8)
        out = attn.forward(q, k, v, self.layer, batch, kv_stored=True)  # [T, Hq * D]
        return project(self.o_proj, out)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, q8=None) -> torch.Tensor:
        """``x [T, hidden]`` to ``[T, hidden]``; ``q8``: ``x`` quantized for the gate/up
        projection by the norm (:func:`project`)."""
        if isinstance(self.gate_up_proj, nn.Linear):
            return project(self.down_proj, gate_up_silu(x, self.gate_up_proj.weight))
        # GGUF blocks: their own product, then SiLU-and-mul (which quantizes its output
        # for the down projection where that reads int8 rows).
        gate_up = project(self.gate_up_proj, x, q8)
        if wants_int8(self.down_proj, gate_up):
            act, act_q8 = silu_and_mul(gate_up, quantize=True)
            return project(self.down_proj, act, act_q8)
        return project(self.down_proj, silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (
            SparseMoeBlock(config, MLP)
            if layer in config.moe_layers
            else MLP(config.hidden_size, config.intermediate_size)
        )
        # Set by CausalLM.use_parallel: o and down are row-parallel, their partial
        # products are summed over the ranks.
        self.tp: TensorParallel | None = None

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the previous layer's MLP output (the embeddings for the first layer,
        with ``residual`` None); ``residual``: the residual stream before it. Returns
        this layer's ``(mlp_output, residual)``; the stream itself is
        ``residual + mlp_output``, summed by the next fused norm.

        Where q/k/v or gate/up read int8 rows (GGUF blocks, decode rows on CUDA), the
        norm before them writes its output quantized too (``q8``), so no launch of their
        own quantizes it."""
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = h
            x, q8 = self.input_layernorm.forward_for(h, qkv_proj)
        else:
            x, residual, q8 = self.input_layernorm.add_forward_for(h, residual, qkv_proj)
        h = self.self_attn(x, batch, attn, cos_sin_cache, q8)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        gate_up_proj = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None  # MoE: the router reads x
        x, residual, q8 = self.post_attention_layernorm.add_forward_for(h, residual, gate_up_proj)
        h = self.mlp(x) if q8 is None else self.mlp(x, q8)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        return h, residual


class DecoderModel(nn.Module):
    """The trunk; named ``model`` inside :class:`CausalLM` so parameter names follow
    Hugging Face's (``model.layers.N....``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(HFWeightLoading, nn.Module):
    """Decoder-only LM over the paged KV cache.

    Build it under ``torch.device("meta")`` and give it storage with
    :func:`engine.loader.meta_build.materialize` (see :func:`engine.loader.load.load_model`); then call :meth:`init_rope_cache` and
    :meth:`load_weights`.

    Attributes:
        cos_sin_cache: ``[max_position_embeddings, head_dim]`` float32 buffer, kept in
            float32 whatever the model dtype (transformers computes cos/sin in float32);
            ``None`` until :meth:`init_rope_cache` (``forward`` calls it if needed).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # A tied head reads the embedding matrix directly: no second parameter to keep
        # tied through materialization / dtype casts, and the weight is counted once.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Filled by init_rope_cache, not here: a None buffer is skipped by ``to(dtype)`` and
        # by materialization, so the cache is never cast to the model dtype or allocated twice.
        self.register_buffer("cos_sin_cache", None, persistent=False)
        # Tensor parallelism (use_parallel): this rank's group and the full vocabulary.
        self.tp: TensorParallel | None = None
        self.full_vocab_size = config.vocab_size
        # A CPU model's decode steps through the C decode layer, where it runs every layer
        # (engine.layers.cpu_decode; set by pack_model_for_cpu).
        self.cpu_decode = None
        # The last layers kept on the CPU (--cpu-layers; engine.layers.host_layers.split_model).
        self.host_layers = None

    def use_parallel(self, tp: TensorParallel, full_vocab_size: int) -> None:
        """Run as one rank of ``tp``: the model was built at the shard's shapes
        (:func:`engine.parallel.shard.rank_config`) and holds this rank's weights;
        ``forward`` then returns logits over all ``full_vocab_size`` tokens on every
        rank."""
        self.tp, self.full_vocab_size = tp, full_vocab_size
        for layer in self.model.layers:
            layer.tp = tp

    def init_rope_cache(self) -> None:
        """(Re)compute :attr:`cos_sin_cache` in float32 on the model's device."""
        device = self.model.norm.weight.device  # the embeddings may be blocks (CPU GGUF)
        self.cos_sin_cache = build_cos_sin_cache(
            self.config.rope, self.config.head_dim, self.config.max_position_embeddings, device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab_size, hidden_size]``: the LM head, or the embeddings when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Run one step: store the new tokens' K/V in the pool and return next-token logits.

        Args:
            batch: the step; its tensors live on the model's device.
            attn: the attention backend over the KV pool; ``attn.prepare(batch)`` is
                called here (not for a step the C decode layer runs: it reads the pool
                itself). With :attr:`host_layers` (``--cpu-layers``) the pool holds the
                device's layers, and the last layers run on the CPU over their own.

        Returns:
            ``[B, vocab_size]`` float32 logits, one row per sequence, at
            ``batch.logits_indices``.
        """
        if self.cos_sin_cache is None:
            self.init_rope_cache()
        if self.tp is None:
            h = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        else:
            h = self.tp.embed(self.model.embed_tokens.weight, batch.input_ids, self.full_vocab_size)
        residual = None
        fast, host = self.cpu_decode, self.host_layers
        layers = self.model.layers if host is None else self.model.layers[:host.start]
        if fast is not None and fast.takes(batch, h, attn.pool):  # the C layers (CPU)
            h, residual = fast.run(h, batch, attn.pool, self.cos_sin_cache, attn=attn)
        elif len(layers):
            attn.prepare(batch)
            for layer in layers:
                h, residual = layer(h, residual, batch, attn, self.cos_sin_cache)
                progress.advance()  # a plain int: no launch, no sync (engine.common.progress)
        if host is not None:  # the last layers on the CPU, over their own pool
            h, residual = host.run(h, residual, batch, attn.pool.num_pages)
        # RMSNorm is per row, so normalizing only the rows that need logits is exact.
        rows = batch.logits_indices
        if residual is None:  # no layers
            h, q8 = self.model.norm.forward_for(h[rows], self.lm_head)
        else:  # [B, hidden]; quantized too for an LM head in blocks that reads int8 rows
            h, _, q8 = self.model.norm.add_forward_for(h[rows], residual[rows], self.lm_head)
        if self.lm_head is None:
            logits = F.linear(h, self.model.embed_tokens.weight).float()
        elif q8 is None:
            logits = self.lm_head(h).float()  # an nn.Linear, or GGUF blocks (QuantLinear)
        else:
            logits = self.lm_head(h, q8=q8).float()
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.full_vocab_size)
        return logits


