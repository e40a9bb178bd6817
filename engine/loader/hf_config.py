"""``config.json`` (+ ``generation_config.json``) -> :class:`ModelConfig`.

We validate the raw JSON ourselves (architecture, required fields) and then let
``transformers.AutoConfig`` read it. AutoConfig earns its place: it applies each model
class's defaults for fields a checkpoint leaves out (Qwen3's ``head_dim`` is 128, not
``hidden_size // num_heads``) and normalizes the three spellings of RoPE parameters
across transformers versions. What it does not do is fail on a missing field: it would
silently fill ``hidden_size=4096``, so required fields are checked in the JSON first.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from engine.common.config import SUPPORTED_ROPE_TYPES, ModelConfig, RopeConfig
from engine.common.load_errors import (
    ConfigFieldMissing,
    ModelLoadError,
    ModelNotFound,
    UnsupportedArchitecture,
    UnsupportedConfig,
)
from engine.loader.gemma4_config import gemma4_fields, is_gemma4
from engine.models.registry import SUPPORTED_ARCHITECTURES, Family, family

REQUIRED_FIELDS: tuple[str, ...] = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)


def _strict_errors() -> tuple[type[Exception], ...]:
    """The error transformers >= 5 raises for a config field of the wrong type or value
    (huggingface_hub's strict dataclasses); none before (ValueError or TypeError). Imported
    when a config is read: huggingface_hub.errors pulls in httpx (~0.1 s)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _one_line(error: Exception) -> str:
    """An error's message on one line (huggingface_hub's strict errors span two)."""
    return " ".join(str(error).split())


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read a Hugging Face model folder's configuration.

    Args:
        model_dir: folder holding ``config.json`` (and optionally
            ``generation_config.json``, whose ``eos_token_id`` is merged in).

    Raises:
        ModelNotFound: ``model_dir/config.json`` does not exist.
        UnsupportedArchitecture: ``architectures[0]`` is not one headroom runs (the
            message lists the supported ones).
        ConfigFieldMissing: a required field is absent (the message names it).
        UnsupportedConfig: a variant headroom does not implement (RoPE scaling type,
            sliding window, activation, MLP bias, partial rotary).
        ModelLoadError: the JSON is unreadable or transformers rejects it; a required
            field is no positive whole number (named), or another value transformers or
            headroom cannot read (wrong type, heads that do not divide the hidden size).

    The facts are cached by the config files' bytes (:mod:`engine.loader.config_cache`):
    a later call, in this process or another, reads them without transformers.
    """
    from engine.loader.config_cache import cached_config, store_config

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if config_path.is_file():
        known = cached_config(model_dir)  # derived before from these very bytes
        if known is not None:
            return known
    try:
        config = _derive(model_dir, config_path)
    except (ValueError, TypeError, ZeroDivisionError) as e:  # a value of the wrong type past the checks
        raise ModelLoadError(f"{config_path} holds a value headroom cannot read ({type(e).__name__}: "
                             f"{_one_line(e)}); restore the file from the model's original repository") from e
    store_config(model_dir, config)
    return config


def _is_count(value: Any) -> bool:
    """A positive whole number (JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _derive(model_dir: Path, config_path: Path) -> ModelConfig:
    """:func:`load_model_config` without the cache."""
    raw = _read_json(config_path, required=True)
    architecture = _architecture(raw, config_path)
    facts = family(architecture)
    text_raw, where = _text_part(raw, facts, config_path)
    # Gemma 3's multimodal checkpoints write their text config sparsely: transformers' text
    # config class fills the rest with the family's own defaults, so nothing is required.
    sparse = "text_config" in raw and not facts.text_config
    for name in REQUIRED_FIELDS if not sparse else ():
        value = text_raw.get(name)
        if name == "intermediate_size" and facts.moe == "all_routed":
            continue  # every MLP routed: the experts' size is moe_intermediate_size
        if value is None:
            raise ConfigFieldMissing(
                f"{config_path} has no {where}{name!r}; it is required to build the model. "
                "Restore the file from the model's original repository."
            )
        if not _is_count(value):
            raise ModelLoadError(f"{config_path}: {where}{name} is {value!r}, not a positive whole number; "
                                 "restore the file from the model's original repository")

    from transformers import AutoConfig  # deferred: importing transformers costs ~1 s

    try:
        hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError, *_strict_errors()) as e:
        raise ModelLoadError(f"transformers cannot read {config_path}: {_one_line(e)}") from e
    # A vision-language checkpoint: the language model's config, its head tied as the
    # outer config says (transformers ties by the outer one).
    tied = raw.get("tie_word_embeddings") if facts.text_config else None
    outer, hf = hf, hf.get_text_config()  # the language model's (itself for a text-only model)
    if tied is None:
        tied = getattr(hf, "tie_word_embeddings", False)
    _check_variant(hf, config_path, facts)
    num_heads = hf.num_attention_heads
    heads = hf.per_layer_config[0] if is_gemma4(hf) else hf  # Gemma 4's differ by layer (gemma4_fields)
    head_dim = getattr(heads, "head_dim", None) or hf.hidden_size // num_heads
    attention_bias = facts.qkv_bias or bool(
        getattr(hf, "qkv_bias", False) or getattr(hf, "attention_bias", False)
    )
    generation = _read_json(model_dir / "generation_config.json", required=False)
    eos = (_token_ids(getattr(hf, "eos_token_id", None)) + _token_ids(getattr(outer, "eos_token_id", None))
           + _token_ids(generation.get("eos_token_id")))
    fields = dict(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=int(getattr(hf, "intermediate_size", None) or 0),  # none: every MLP routed
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(heads, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=_context(hf),
        rope=_rope_of(hf.rope_parameters["full_attention"], hf, config_path) if _is_gemma3(hf)
        else _rope(hf, config_path, facts),  # Gemma 3: its global layers' (rope_local: the sliding ones')
        tie_word_embeddings=bool(tied),
        attention_bias=attention_bias,
        qk_norm=facts.qk_norm,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(eos)),  # dedupe, keep order
        qk_norm_whole=facts.qk_norm_whole,
        clip_qkv=getattr(hf, "clip_qkv", None),
        **_moe_fields(hf, facts, config_path),
        **_hybrid_fields(hf, facts, head_dim),
        **_gemma3_fields(hf, config_path),
        **_gpt_oss_fields(hf, config_path),
    )
    return ModelConfig(**{**fields, **gemma4_fields(hf, config_path)})  # Gemma 4: its pool's heads, its RoPEs


def _gpt_oss_fields(hf: Any, config_path: Path) -> dict[str, Any]:
    """gpt-oss's fields of :class:`ModelConfig` (``{}`` for other models): its alternating
    sliding and full layers, the attention sinks, and its experts' biases and clamped
    SwiGLU (``GptOssConfig``: experts of ``intermediate_size`` in every layer, the top-k
    router logits softmaxed alone).

    Raises:
        UnsupportedConfig: the experts are quantized otherwise than in MXFP4 blocks (as
            OpenAI's checkpoints keep them, and the model keeps them so:
            :attr:`ModelConfig.expert_block_type`)."""
    if getattr(hf, "model_type", "") != "gpt_oss":
        return {}
    quant = getattr(hf, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method not in (None, "mxfp4"):
        raise UnsupportedConfig(f"{config_path}: gpt-oss with {method} weights is not supported; "
                                "headroom reads its bfloat16 or MXFP4 checkpoints")
    return {
        "layer_types": tuple(hf.layer_types),
        "sliding_window": _window(hf, config_path),
        "attention_sinks": True,
        "expert_bias": True,
        "swiglu_alpha": float(getattr(hf, "swiglu_alpha", 1.702)),  # older transformers fix it at 1.702
        "swiglu_limit": float(getattr(hf, "swiglu_limit", 7.0)),
        "expert_block_type": "MXFP4" if method == "mxfp4" else "",
    }


def _window(hf: Any, config_path: Path) -> int:
    """The ``sliding_window`` of a model whose ``layer_types`` name sliding layers: a
    positive token count (transformers fails on 0 only in its forward pass)."""
    window = hf.sliding_window
    if "sliding_attention" in (hf.layer_types or ()) and not _is_count(window):
        raise ModelLoadError(f"{config_path}: sliding_window is {window!r}, not a positive whole number, "
                             "while layer_types has sliding_attention layers; restore the file from the "
                             "model's original repository")
    return int(window or 0)


def _is_gemma3(hf: Any) -> bool:
    return getattr(hf, "model_type", "") == "gemma3_text"


def _gemma3_fields(hf: Any, config_path: Path) -> dict[str, Any]:
    """Gemma 3's fields of :class:`ModelConfig` (``{}`` for other models): its layer
    kinds and window, the local layers' RoPE, the attention scale and the logits' soft-cap
    (``Gemma3TextConfig``; transformers derives ``layer_types`` from the older
    ``sliding_window_pattern`` where a config has that instead). Gemma 3 keeps Gemma 2's
    ``attn_logit_softcapping`` field, but its attention never applies it (transformers'
    ``Gemma3Attention`` does not pass it on; the q/k norms took its place), so neither
    do we."""
    if not _is_gemma3(hf):
        return {}
    return {
        "layer_types": tuple(hf.layer_types),
        "sliding_window": _window(hf, config_path),
        "rope_local": _rope_of(hf.rope_parameters["sliding_attention"], hf, config_path),
        "query_pre_attn_scalar": float(hf.query_pre_attn_scalar or 0),
        "final_logit_softcapping": float(hf.final_logit_softcapping or 0),
        "hidden_act": hf.hidden_activation,
    }


def _text_part(raw: dict[str, Any], facts: Family, config_path: Path) -> tuple[dict[str, Any], str]:
    """The part of ``config.json`` that describes the language model, and how a message
    names its place: the whole file, or a vision-language checkpoint's ``text_config``.

    Raises:
        ConfigFieldMissing: the family nests its config and the file has no ``text_config``.
    """
    if not facts.text_config:
        return raw, ""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigFieldMissing(
            f"{config_path} has no 'text_config', where a {raw['architectures'][0]} checkpoint keeps its "
            "language model's config. Restore the file from the model's original repository."
        )
    return text, "text_config."


def _hybrid_fields(hf: Any, facts: Family, head_dim: int) -> dict[str, Any]:
    """Qwen3-Next's (and Qwen3.5's) linear-attention fields of :class:`ModelConfig` (``{}`` for the
    others). ``layer_types`` is transformers' own list (its default puts a full-attention
    layer every ``full_attention_interval``); the rotary part of a head is
    ``int(head_dim * partial_rotary_factor)`` (``Qwen3NextRotaryEmbedding``)."""
    if not facts.hybrid:
        return {}
    rope = getattr(hf, "rope_parameters", None) or {}
    factor = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0)
    return {
        "layer_types": tuple(hf.layer_types),
        "linear_num_key_heads": int(hf.linear_num_key_heads),
        "linear_num_value_heads": int(hf.linear_num_value_heads),
        "linear_key_head_dim": int(hf.linear_key_head_dim),
        "linear_value_head_dim": int(hf.linear_value_head_dim),
        "linear_conv_kernel_dim": int(hf.linear_conv_kernel_dim),
        "rotary_dim": int(head_dim * factor),
        "attn_output_gate": True,
        "zero_centered_norms": True,
    }


def _moe_fields(hf: Any, facts: Family, config_path: Path) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelConfig`, as each family's
    transformers config names them; ``{}`` for a dense model.

    Mixtral and OLMoE route in every layer and size experts by ``intermediate_size``;
    Qwen2-MoE and Qwen3-MoE size them by ``moe_intermediate_size`` and keep a dense MLP
    in ``mlp_only_layers`` and in layers ``i`` with ``(i + 1) % decoder_sparse_step != 0``
    (``Qwen3MoeDecoderLayer``); Qwen3.5-MoE routes in every layer with experts of
    ``moe_intermediate_size``. Mixtral and Qwen3.5-MoE always renormalize the top-k
    weights (``MixtralTopKRouter``, ``Qwen3_5MoeTopKRouter``); the others do when
    ``norm_topk_prob``.
    """
    num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
    if not facts.moe:
        return {}
    layers = range(hf.num_hidden_layers)
    if facts.moe == "every_layer":
        moe_layers = tuple(layers) if num_experts > 0 else ()
        expert_size = hf.intermediate_size
    elif facts.moe == "all_routed":
        moe_layers = tuple(layers) if num_experts > 0 else ()
        expert_size = hf.moe_intermediate_size
    else:
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        moe_layers = tuple(i for i in layers if num_experts > 0 and i not in dense and (i + 1) % step == 0)
        expert_size = hf.moe_intermediate_size
    norm_topk = facts.renormalize_top_k or bool(getattr(hf, "norm_topk_prob", False))
    top_k = hf.num_experts_per_tok
    if num_experts > 0 and not (_is_count(top_k) and top_k <= num_experts):
        # The router's top-k would fail in the first forward pass, a crash loop under serve.
        raise ModelLoadError(f"{config_path}: num_experts_per_tok is {top_k!r}, not a whole number from 1 to "
                             f"the {num_experts} experts; restore the file from the model's original repository")
    return {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(hf.num_experts_per_tok),
        "moe_intermediate_size": int(expert_size),
        "norm_topk_prob": norm_topk,
        "shared_expert_intermediate_size": int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
        if facts.shared_expert else 0,
        "moe_layers": moe_layers,
    }


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if not required:
            return {}
        raise ModelNotFound(
            f"{path} does not exist: {path.parent} is not a Hugging Face model folder. "
            "Pass a folder holding config.json and *.safetensors, or a .gguf file."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(
            f"{path} is not valid JSON ({e}); restore it from the model's source"
        ) from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def _architecture(raw: dict[str, Any], config_path: Path) -> str:
    architectures = raw.get("architectures")
    if not architectures:
        raise ConfigFieldMissing(
            f"{config_path} has no 'architectures'; add e.g. "
            f'"architectures": ["LlamaForCausalLM"] (supported: {", ".join(SUPPORTED_ARCHITECTURES)})'
        )
    architecture = architectures[0]
    try:
        family(architecture)
    except UnsupportedArchitecture as e:
        raise UnsupportedArchitecture(f"{config_path}: {e}") from None
    return architecture


def _context(hf: Any) -> int:
    """The model's context in tokens. A Mistral sliding window shorter than the context
    (Mistral 7B v0.1: 4096 of 32768) caps it: within the window, full attention is the
    same computation, and headroom has no sliding-window kernels."""
    window = getattr(hf, "sliding_window", None) if getattr(hf, "model_type", "") in ("mistral", "mixtral") else None
    if window:
        return min(hf.max_position_embeddings, int(window))
    return hf.max_position_embeddings


def _check_variant(hf: Any, config_path: Path, facts: Family) -> None:
    gemma = _is_gemma3(hf) or is_gemma4(hf)
    act = getattr(hf, "hidden_activation", "gelu_pytorch_tanh") if gemma else getattr(hf, "hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise UnsupportedConfig(f"{config_path}: hidden activation {act!r} is not supported")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedConfig(f"{config_path}: mlp_bias=true is not supported")
    # Gemma 4's "vision": image tokens see each other both ways, text stays causal.
    if getattr(hf, "use_bidirectional_attention", False) not in (False, None, "vision"):
        raise UnsupportedConfig(f"{config_path}: bidirectional attention (an encoder) is not supported")
    layer_types = getattr(hf, "layer_types", None) or ()
    windowed = gemma or getattr(hf, "model_type", "") == "gpt_oss"
    known = (("full_attention", "linear_attention") if facts.hybrid
             else ("full_attention", "sliding_attention") if windowed else ("full_attention",))
    if getattr(hf, "use_sliding_window", False) or any(t not in known for t in layer_types):
        raise UnsupportedConfig(
            f"{config_path}: sliding-window attention is not supported; "
            "set use_sliding_window to false if the model was trained without it"
        )


def _rope(hf: Any, config_path: Path, facts: Family) -> RopeConfig:
    # transformers >= 5 keeps everything in ``rope_parameters``; older versions use
    # ``rope_theta`` plus an optional ``rope_scaling`` dict (whose type key was once "type").
    return _rope_of(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None), hf, config_path,
                    hybrid=facts.hybrid)


def _rope_of(params: dict | None, hf: Any, config_path: Path, hybrid: bool = False) -> RopeConfig:
    """The :class:`RopeConfig` of one ``rope_parameters`` dict (Gemma 3 has one per layer
    kind); a ``hybrid`` model's partial rotary is taken (its layers rotate part of a head)."""
    params = dict(params or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfig(
            f"{config_path}: RoPE type {rope_type!r} is not supported; headroom implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    # The hybrids' partial rotary is ModelConfig.rotary_dim (engine.models.qwen3_next).
    # Qwen3.5's multimodal RoPE sections turn text as plain RoPE (engine.models.qwen3_5).
    if partial not in (None, 1, 1.0) and not hybrid:
        raise UnsupportedConfig(f"{config_path}: partial_rotary_factor {partial} is not supported")
    defaults = RopeConfig()
    fields = {
        "theta": float(theta if theta is not None else defaults.theta),
        "rope_type": rope_type,
        "factor": float(params.get("factor", defaults.factor)),
        "low_freq_factor": float(params.get("low_freq_factor", defaults.low_freq_factor)),
        "high_freq_factor": float(params.get("high_freq_factor", defaults.high_freq_factor)),
        "original_max_position_embeddings": int(
            params.get("original_max_position_embeddings") or hf.max_position_embeddings
        ),
    }
    return RopeConfig(**{**fields, **(_yarn_fields(params, hf) if rope_type == "yarn" else {})})


def _yarn_fields(params: dict, hf: Any) -> dict[str, Any]:
    """YaRN's parameters of :class:`RopeConfig`, as transformers' ``_compute_yarn_parameters``
    reads them: ``factor`` None is the context over the original one; ``attention_factor``
    unset is derived from ``mscale``/``mscale_all_dim`` where both are given (else left 0:
    :func:`engine.layers.rope.attention_factor` derives it from ``factor``)."""
    original = int(params.get("original_max_position_embeddings") or hf.max_position_embeddings)
    factor = float(params.get("factor") or hf.max_position_embeddings / original)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = params.get("attention_factor")
    if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(params["mscale"]) / mscale(params["mscale_all_dim"])
    return {"factor": factor, "beta_fast": float(params.get("beta_fast") or 32),
            "beta_slow": float(params.get("beta_slow") or 1), "truncate": bool(params.get("truncate", True)),
            "attention_factor": float(attention or 0.0)}


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
