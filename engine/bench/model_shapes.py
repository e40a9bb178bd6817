"""Configs of real models' shapes, for random-weight benchmarks and GPU tests.

No hub is reachable, so these are written from the published configs' numbers
(Qwen/Qwen3-0.6B, meta-llama/Llama-3.1-8B, HuggingFaceTB/SmolLM2-135M-Instruct,
Qwen/Qwen3-30B-A3B, Qwen/Qwen3-Next-80B-A3B-Instruct and Qwen/Qwen3.6-35B-A3B ``config.json``) and loaded with
``load_format="dummy"`` (random weights) or saved with random weights by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

# What the Qwen3 family's published configs share (dense and MoE alike).
_QWEN3: dict = {
    "vocab_size": 151936,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

# What the published hybrids (Qwen3-Next-80B-A3B, Qwen3.5/3.6-35B-A3B) share: the trunk's
# widths, a full-attention layer in four, the Gated DeltaNet's heads, the experts' sizes.
_QWEN_HYBRID: dict = {
    "hidden_size": 2048,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}

SHAPES: dict[str, dict] = {
    # The embedded default model's shape (its GGUF's metadata agrees).
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        **_QWEN3,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B's config.json (the shape of the tensor-parallel GPU test and bench).
    "qwen3-8b": {
        **_QWEN3,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    # A mixture of experts: 48 layers of 128 experts (8 routed per token), 30.5B
    # parameters of which 3.3B active; the experts are 29.0B of them.
    "qwen3-30b-a3b": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    # A hybrid: 36 Gated DeltaNet layers and 12 gated full-attention layers (one in four),
    # 512 experts (10 routed per token) plus a shared expert in every layer; 80B
    # parameters of which 3B active. Its published config.
    "qwen3-next-80b-a3b": {
        **_QWEN_HYBRID,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # Qwen3.6-35B-A3B (Qwen3.5-35B-A3B's shape), as published: a vision-language
    # checkpoint whose language model is a hybrid of 30 Gated DeltaNet layers and 10
    # gated full-attention layers, 256 experts (8 routed per token) plus a shared expert
    # in every layer; 35B parameters of which 3B active. Its text_config's numbers.
    "qwen3.6-35b-a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            **_QWEN_HYBRID,
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 248320,
            "num_hidden_layers": 40,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "eos_token_id": 248046,
        },
        "torch_dtype": "bfloat16",
    },
}


def write_shape(name: str, folder: str | Path, **overrides) -> Path:
    """Write ``config.json`` of shape ``name`` (with ``overrides``; a vision-language
    shape's go into its ``text_config``) into ``folder``.

    Raises:
        KeyError: an unknown shape; the message lists the known ones.
    """
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[name]
    if "text_config" in shape:
        shape = {**shape, "text_config": {**shape["text_config"], **overrides}}
    else:
        shape = {**shape, **overrides}
    (folder / "config.json").write_text(json.dumps(shape, indent=2))
    return folder
