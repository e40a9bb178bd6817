"""The sparse MLP of mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE).

A router (``gate``, ``[E, H]``) scores every expert per token; :func:`kernels.moe.reference.route`
keeps the top ``num_experts_per_tok``; the experts run through
:data:`kernels.dispatch.fused_moe` (the Triton grouped GEMM on CUDA, the torch loop over
experts elsewhere). Qwen2-MoE adds a shared expert every token goes through, scaled by
``sigmoid(shared_expert_gate(x))`` (``Qwen2MoeSparseMoeBlock`` in transformers).

Parameter names follow transformers 5 (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``); checkpoints name each expert's
projections apart (``mlp.experts.N.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.N.w1.weight``), and :meth:`engine.models.decoder.CausalLM.load_weights`
stacks them into these at load.

By default all experts live on the model's device. A layer whose routed experts live in
host memory has :class:`engine.layers.moe.expert_cache.OffloadedExperts` in place of
:class:`Experts` (a device expert cache in front of the host copy); a GGUF's experts kept
in their blocks (``--gguf-quantized``) have :class:`engine.layers.moe.quant_experts.QuantExperts`.
Both are called as ``experts(x, weights, ids)``; the router and the shared expert stay
here, on the device.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.common.config import ModelConfig
from kernels.dispatch import fused_moe
from kernels.moe.reference import route

# transformers' Qwen and OLMoE routers round the top-k weights to the activation dtype
# before they scale the expert outputs; Mixtral's keep float32 (``MixtralTopKRouter``).
_WEIGHTS_IN_FLOAT32 = {"MixtralForCausalLM"}


class Experts(nn.Module):
    """The routed experts of one layer, stacked: ``gate_up_proj`` ``[E, 2I, H]`` (gate
    rows first), ``down_proj`` ``[E, H, I]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dense_mlp: type[nn.Module]) -> None:
        """``dense_mlp(hidden, intermediate)`` builds the shared expert (Qwen2-MoE)."""
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.float32_weights = config.architecture in _WEIGHTS_IN_FLOAT32
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = dense_mlp(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x``'s dtype."""
        weights, ids = route(nn.functional.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        if isinstance(self.experts, Experts):
            out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:  # offloaded (the store picks cache, copy or CPU per expert) or GGUF blocks
            out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
