"""The sparse MLP of mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE,
gpt-oss).

A router (``gate``, ``[E, H]``) scores every expert per token; :func:`kernels.moe.reference.route`
keeps the top ``num_experts_per_tok``; the experts run through
:data:`kernels.dispatch.fused_moe` (the Triton grouped GEMM on CUDA, the torch loop over
experts elsewhere). Qwen2-MoE adds a shared expert every token goes through, scaled by
``sigmoid(shared_expert_gate(x))`` (``Qwen2MoeSparseMoeBlock`` in transformers).
gpt-oss's router and experts carry biases (:attr:`ModelConfig.expert_bias`) and its
experts apply the clamped SwiGLU (:attr:`ModelConfig.swiglu_limit`,
:class:`kernels.activation.reference.ClampedSwiGLU`); those experts stay on
the device (:func:`engine.layers.moe.expert_stacks.stack_of` refuses to offload them).

Parameter names follow transformers 5 (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``); checkpoints name each expert's
projections apart (``mlp.experts.N.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.N.w1.weight``), and :meth:`engine.models.decoder.CausalLM.load_weights`
stacks them into these at load.

By default all experts live on the model's device. A layer whose routed experts live in
host memory has :class:`engine.layers.moe.expert_cache.OffloadedExperts` in place of
:class:`Experts` (a device expert cache in front of the host copy); a GGUF's experts kept
in their blocks (``--gguf-quantized``), and a checkpoint's experts stored in blocks
(:attr:`ModelConfig.expert_block_type`: gpt-oss's MXFP4), have
:class:`engine.layers.moe.quant_experts.QuantExperts`.
Both are called as ``experts(x, weights, ids)``; the router and the shared expert stay
here, on the device.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.common.config import ModelConfig
from engine.layers.moe.quant_experts import QuantExperts, experts_activation, quant_experts_for
from kernels.activation.reference import ClampedSwiGLU
from kernels.dispatch import fused_moe
from kernels.moe.reference import ExpertBiases, route

# transformers' Qwen and OLMoE routers round the top-k weights to the activation dtype
# before they scale the expert outputs; Mixtral's keep float32 (``MixtralTopKRouter``).
_WEIGHTS_IN_FLOAT32 = {"MixtralForCausalLM"}


class Experts(nn.Module):
    """The routed experts of one layer, stacked: ``gate_up_proj`` ``[E, 2I, H]`` (gate
    rows first), ``down_proj`` ``[E, H, I]``; with ``bias``, ``gate_up_proj_bias``
    ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]`` too. ``activation``: None for
    SiLU-and-mul, else the one gate/up's output goes through."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.activation = activation

    @property
    def biases(self) -> ExpertBiases | None:
        if self.gate_up_proj_bias is None:
            return None
        return ExpertBiases(self.gate_up_proj_bias, self.down_proj_bias)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """:data:`kernels.dispatch.fused_moe` over these experts: ``x`` ``[T, H]``,
        ``topk_weights``/``topk_ids`` ``[T, K]`` -> ``[T, H]``."""
        if self.activation is None and self.gate_up_proj_bias is None:  # every kernel's case
            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, biases=self.biases,
                         activation=self.activation)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dense_mlp: type[nn.Module]) -> None:
        """``dense_mlp(hidden, intermediate)`` builds the shared expert (Qwen2-MoE)."""
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.float32_weights = config.architecture in _WEIGHTS_IN_FLOAT32
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=config.expert_bias)
        if config.expert_block_type:  # kept in the checkpoint's blocks (gpt-oss's MXFP4)
            self.experts = quant_experts_for(config, (config.expert_block_type,) * 3)
        else:
            self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                   config.expert_bias, experts_activation(config))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = dense_mlp(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x``'s dtype."""
        # GGUF blocks the C kernels run are routed inside their call (a CPU decode step's
        # MoE layer in one call, the router's product too); else routed here.
        out = self.experts.routed(x, self.gate, self.top_k, self.renormalize) if isinstance(self.experts, QuantExperts) else None
        if out is None:
            weights, ids = route(nn.functional.linear(x, self.gate.weight, self.gate.bias), self.top_k, self.renormalize)
            if not self.float32_weights:
                weights = weights.to(x.dtype)
            # Resident (Experts), offloaded (the store picks cache, copy or CPU per expert)
            # or GGUF blocks: each called alike.
            out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
