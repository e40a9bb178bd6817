"""The model families headroom runs: ``config.json``'s ``architectures[0]`` -> the class
that implements it and the facts its ``config.json`` leaves implicit.

Torch-free: the table names each class as a ``"module:attr"`` string, imported on first
:func:`get_model_class` (:class:`~engine.common.lazy_registry.LazyRegistry`), so the
config reader, ``headroom plan`` and the service check a name without importing torch.
A new family is its model file plus one :class:`Family` line here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.common.lazy_registry import LazyRegistry
from engine.common.load_errors import UnsupportedArchitecture

_DECODER = "engine.models.decoder:CausalLM"
_HYBRID = "engine.models.qwen3_next:HybridCausalLM"
_QWEN35 = "engine.models.qwen3_5:Qwen35CausalLM"


@dataclass(frozen=True)
class Family:
    """One architecture: ``model`` (the class, ``"module:attr"``) and what
    :func:`engine.loader.hf_config.load_model_config` cannot read from its config.

    Attributes:
        qkv_bias: q/k/v projections always carry a bias (Qwen2's, implied by the name).
        qk_norm: RMSNorm over each head of q and k (Qwen3's families).
        qk_norm_whole: q/k RMSNorm over the whole projection instead (OLMoE).
        moe: the mixture-of-experts layout: ``""`` dense; ``"every_layer"`` routes in
            every layer, experts sized by ``intermediate_size`` (Mixtral, OLMoE);
            ``"sparse_step"`` sizes them by ``moe_intermediate_size`` and keeps dense
            MLPs in ``mlp_only_layers`` and off ``decoder_sparse_step`` (Qwen MoE);
            ``"all_routed"`` routes in every layer, experts sized by
            ``moe_intermediate_size``, and has no dense MLP (no ``intermediate_size``;
            Qwen3.5-MoE).
        renormalize_top_k: top-k routing weights always renormalized (Mixtral); else
            as ``norm_topk_prob`` says.
        shared_expert: a shared expert beside the routed ones, sized by
            ``shared_expert_intermediate_size``.
        hybrid: Gated DeltaNet linear-attention layers between full-attention ones.
        text_config: a vision-language checkpoint: the language model's config is
            ``config.json``'s ``text_config``; the model reads only its tensors.
    """

    model: str = _DECODER
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False
    moe: str = ""
    renormalize_top_k: bool = False
    shared_expert: bool = False
    hybrid: bool = False
    text_config: bool = False


_QWEN35_DENSE = Family(model=_QWEN35, qk_norm=True, hybrid=True)
_QWEN35_MOE = Family(model=_QWEN35, qk_norm=True, moe="all_routed", renormalize_top_k=True, shared_expert=True,
                     hybrid=True)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),  # the Llama layout (Mistral, Ministral)
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    # Mixtures of experts: the same decoder with engine.layers.moe.sparse_moe's sparse MLP.
    "Qwen2MoeForCausalLM": Family(moe="sparse_step", shared_expert=True),  # shared expert behind a sigmoid gate
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe="sparse_step"),
    "MixtralForCausalLM": Family(moe="every_layer", renormalize_top_k=True),
    "OlmoeForCausalLM": Family(qk_norm_whole=True, moe="every_layer"),
    # Hybrid linear attention: Gated DeltaNet layers between gated full-attention
    # layers, MoE or dense MLPs, over a state pool.
    "Qwen3NextForCausalLM": Family(model=_HYBRID, qk_norm=True, moe="sparse_step", shared_expert=True,
                                   hybrid=True),
    # Sliding-window and global layers, scaled embeddings, soft-capping; a vision checkpoint's text part only.
    # Attention sinks, alternating sliding and full layers, YaRN; experts with biases and a clamped SwiGLU.
    "GptOssForCausalLM": Family(model="engine.models.gpt_oss:GptOssCausalLM", moe="every_layer", renormalize_top_k=True),
    **dict.fromkeys(("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), Family(model="engine.models.gemma3:Gemma3CausalLM")),
    # Gemma 3's layout with per-kind head sizes, shared KV, per-layer embeddings (engine.models.gemma4).
    **dict.fromkeys(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), Family(model="engine.models.gemma4:Gemma4CausalLM")),
    # Qwen3.5 / Qwen3.6: Qwen3-Next's hybrid with flat linear-attention projections; the
    # published checkpoints are vision-language ones, of which the language model runs.
    "Qwen3_5ForCausalLM": _QWEN35_DENSE,
    "Qwen3_5MoeForCausalLM": _QWEN35_MOE,
    "Qwen3_5ForConditionalGeneration": replace(_QWEN35_DENSE, text_config=True),
    "Qwen3_5MoeForConditionalGeneration": replace(_QWEN35_MOE, text_config=True),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)

_MODELS = LazyRegistry("architecture", {name: family.model for name, family in FAMILIES.items()})


def family(architecture: str) -> Family:
    """The :class:`Family` of ``architecture``.

    Raises:
        UnsupportedArchitecture: not one of :data:`SUPPORTED_ARCHITECTURES`; the message
            lists those.
    """
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; headroom runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def get_model_class(architecture: str) -> type:
    """The class that implements ``architecture`` (a
    :class:`~engine.models.decoder.CausalLM`), imported on first use.

    Raises:
        UnsupportedArchitecture: not one of :data:`SUPPORTED_ARCHITECTURES`; the message
            lists those.
    """
    family(architecture)
    return _MODELS.get(architecture)
