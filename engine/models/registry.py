"""Architecture name (``config.json``'s ``architectures[0]``) -> model class."""

from __future__ import annotations

from engine.common.config import SUPPORTED_ARCHITECTURES
from engine.common.load_errors import UnsupportedArchitecture
from engine.models.decoder import CausalLM
from engine.models.qwen3_next import HybridCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    # Mixtures of experts: the same decoder with engine.layers.moe.sparse_moe's sparse MLP.
    "Qwen2MoeForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "OlmoeForCausalLM": CausalLM,
    # Gated DeltaNet layers between gated full-attention layers, over a state pool.
    "Qwen3NextForCausalLM": HybridCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class that implements ``architecture``.

    Raises:
        UnsupportedArchitecture: not one of :data:`engine.common.config.SUPPORTED_ARCHITECTURES`;
            the message lists those.
    """
    try:
        return _MODELS[architecture]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; headroom runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
