"""A GGUF file's metadata as a Hugging Face model's: ``config.json``'s fields (following
transformers' ``integrations/ggml.py`` mapping), RoPE scaling recovered from llama.cpp's
factors, and the recommended sampling as ``generation_config.json`` fields; with the
checks a conversion makes before it writes anything (architecture, tensor types)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from engine.common.load_errors import (
    CorruptWeights,
    ModelLoadError,
    UnsupportedArchitecture,
    UnsupportedConfig,
    UnsupportedGGUFType,
)
from engine.loader.gguf_gpt_oss import ARCHITECTURES as GPT_OSS_ARCHITECTURES
from engine.loader.gguf_gpt_oss import gpt_oss_config
from engine.loader.gguf_qwen35 import ARCHITECTURES as QWEN35_ARCHITECTURES
from engine.loader.gguf_qwen35 import hybrid_config
from engine.loader.gguf_tensors import open_tensors

log = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> (Hugging Face architecture, model_type).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    **QWEN35_ARCHITECTURES,
    **GPT_OSS_ARCHITECTURES,
}


# llama.cpp files Mixtral under "llama", with experts (``llama.expert_count``).
LLAMA_WITH_EXPERTS = ("MixtralForCausalLM", "mixtral")


ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE factors; folded into config.json


def read_checked(gguf_path: Path) -> tuple[Any, str, dict]:
    """``(reader, GGUF architecture, Hugging Face config)`` of ``gguf_path``, with every
    refusal of :func:`convert_gguf` made before anything is written."""
    from engine.loader.gguf_tokenizer import check_tokenizer_keys

    reader = open_reader(gguf_path)
    gguf_arch = field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{gguf_path}: GGUF architecture {gguf_arch!r} is not supported; headroom "
            f"converts {', '.join(GGUF_ARCHITECTURES)}"
        )
    _check_types(reader, gguf_path)
    check_tokenizer_keys(reader, gguf_path)
    return reader, gguf_arch, _hf_config(reader, gguf_path, gguf_arch)


def open_reader(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path} is not a file")
    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        # gguf's reader fails on a numpy reshape where the file is truncated: the tensor
        # table's own check names that (open_tensors raises CorruptWeights saying so).
        open_tensors(gguf_path).release()
        raise CorruptWeights(
            f"{gguf_path} is not a readable GGUF file ({e}); download it again"
        ) from e


def field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _check_types(reader: Any, gguf_path: Path) -> None:
    """Every tensor's type can be dequantized; tensors whose first row holds NaN or
    infinite values (a corrupt file) are named in one warning line, instead of numpy's
    RuntimeWarnings.

    Raises:
        UnsupportedGGUFType: naming the first tensor of a type gguf-py cannot dequantize.
    """
    from gguf import dequantize

    corrupt = []
    for t in reader.tensors:
        try:
            with np.errstate(all="ignore"):  # one row: cheap, and hits the same dispatch
                row = dequantize(t.data[:1], t.tensor_type)
                if not np.isfinite(row).all():
                    corrupt.append(t.name)
        except NotImplementedError:
            raise UnsupportedGGUFType(
                f"{gguf_path}: tensor {t.name} is stored as {t.tensor_type.name}, which "
                "headroom cannot dequantize; use a GGUF with F32/F16/BF16, Q4_0..Q8_0, "
                "K-quants or IQ-quants, or the original Hugging Face checkpoint"
            ) from None
    if corrupt:
        log.warning(
            "%s holds NaN or infinite values in %s: the file is likely corrupt (download or convert it "
            "again); requests on this model may fail with invalid_logits",
            gguf_path, ", ".join(corrupt),
        )


def _hf_config(reader: Any, gguf_path: Path, gguf_arch: str) -> dict[str, Any]:
    """config.json fields, following transformers' ``integrations/ggml.py`` mapping."""
    architecture, model_type = GGUF_ARCHITECTURES[gguf_arch]
    experts = int(field(reader, f"{gguf_arch}.expert_count", 0) or 0)
    if gguf_arch == "llama" and experts:
        architecture, model_type = LLAMA_WITH_EXPERTS

    def get(key: str, default: Any = None) -> Any:
        value = field(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{gguf_path} lacks the metadata key {gguf_arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = field(reader, f"{gguf_arch}.vocab_size")
    if vocab is None:  # older files: the vocabulary length is the truth
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = field(reader, f"{gguf_arch}.attention.key_length") or (hidden // heads)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        # Qwen3.5-MoE routes every layer: no dense MLP width.
        "intermediate_size": int(get("feed_forward_length", 0 if gguf_arch == "qwen35moe" else None)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if gguf_arch == "qwen2moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in names
    elif gguf_arch != "qwen2":  # Qwen2's q/k/v bias is implied by its architecture
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if experts:
        config.update(_moe_config(reader, gguf_arch, experts, names, config["num_hidden_layers"], get))
    if gguf_arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    scaling = _rope_scaling(reader, gguf_path, gguf_arch, config)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if gguf_arch in QWEN35_ARCHITECTURES:
        config.update(hybrid_config(get, lambda key: field(reader, key), names, config))
        del config["rope_theta"]  # in rope_parameters, with the partial rotary
        if gguf_arch == "qwen35moe":
            del config["intermediate_size"]
    if gguf_arch in GPT_OSS_ARCHITECTURES:
        config.update(gpt_oss_config(get, config["num_hidden_layers"]))
        if "rope_scaling" in config:  # gpt-oss's YaRN does not truncate its correction range
            config["rope_scaling"]["truncate"] = False
    return config


def _moe_config(reader: Any, gguf_arch: str, experts: int, names: set[str], layers: int, get) -> dict[str, Any]:
    """The mixture-of-experts fields of config.json. GGUF has no ``mlp_only_layers``:
    a layer without a router (``ffn_gate_inp``) is dense. Whether the top-k weights are
    renormalized is ``expert_weights_norm`` where the file says, else the family's rule
    as llama.cpp builds it (Qwen3-MoE and Mixtral yes, Qwen2-MoE no)."""
    used = int(get("expert_used_count"))
    if gguf_arch in ("llama", *GPT_OSS_ARCHITECTURES):  # every layer routed
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    if gguf_arch == "qwen35moe":  # every layer routed, top-k renormalized, a shared expert
        return {"num_experts": experts, "num_experts_per_tok": used,
                "moe_intermediate_size": int(get("expert_feed_forward_length")),
                "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length"))}
    moe: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": bool(field(reader, f"{gguf_arch}.expert_weights_norm", gguf_arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
    }
    if gguf_arch == "qwen2moe":
        moe["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return moe


# llama.cpp's Gemma 3 (``llama-model.cpp``): five sliding layers to one global unless the
# file says otherwise, the sliding layers' RoPE base 10,000, and Gemma 3 27B (62 blocks)
# the one size whose attention scale is ``(hidden / heads) ** -0.5``, not ``head_dim``'s.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10_000.0
_GEMMA3_27B_BLOCKS = 62


def _gemma3_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config.json fields from a ``gemma3`` GGUF, as llama.cpp reads the file:
    the window, the layer kinds, the local RoPE base, the attention scale and the
    logits' soft-cap (GGUF's RoPE scaling, read as for the other families, is the
    global layers')."""
    layers = config["num_hidden_layers"]
    pattern = int(field(reader, "gemma3.attention.sliding_window_pattern", _GEMMA3_PATTERN) or _GEMMA3_PATTERN)
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == _GEMMA3_27B_BLOCKS \
        else config["head_dim"]
    cap = field(reader, "gemma3.final_logit_softcapping")
    return {
        "sliding_window": int(field(reader, "gemma3.attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": float(field(reader, "gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_BASE)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": float(cap) if cap is not None else None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _rope_scaling(
    reader: Any, gguf_path: Path, gguf_arch: str, config: dict[str, Any]
) -> dict[str, Any] | None:
    scaling_type = field(reader, f"{gguf_arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        pass
    elif scaling_type == "linear":
        return {
            "rope_type": "linear",
            "factor": float(field(reader, f"{gguf_arch}.rope.scaling.factor")),
        }
    elif scaling_type == "yarn":
        return _yarn(reader, gguf_path, gguf_arch)
    else:
        raise UnsupportedConfig(f"{gguf_path}: RoPE scaling {scaling_type!r} is not supported")
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is None:
        return None
    return _llama3_from_factors(np.asarray(rope_freqs.data, dtype=np.float32), gguf_path, config)


# llama.cpp's YaRN keys (under ``<arch>.rope.scaling.``) -> transformers' rope_scaling fields.
_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}


def _yarn(reader: Any, gguf_path: Path, gguf_arch: str) -> dict[str, Any]:
    """transformers' YaRN ``rope_scaling`` from llama.cpp's keys (those it leaves out take
    transformers' defaults)."""
    scaling: dict[str, Any] = {"rope_type": "yarn"}
    for key, name in (("factor", "factor"), ("original_context_length", "original_max_position_embeddings")):
        value = field(reader, f"{gguf_arch}.rope.scaling.{key}")
        if value is None:
            raise ModelLoadError(f"{gguf_path}: YaRN RoPE scaling without {gguf_arch}.rope.scaling.{key}")
        scaling[name] = float(value) if key == "factor" else int(value)
    for key, name in _YARN_KEYS.items():
        value = field(reader, f"{gguf_arch}.rope.scaling.{key}")
        if value is not None:
            scaling[name] = float(value)
    return scaling


def _llama3_from_factors(
    factors: np.ndarray, gguf_path: Path, config: dict[str, Any]
) -> dict[str, Any]:
    """Recover Llama 3 RoPE parameters from llama.cpp's per-frequency divisors.

    llama.cpp's converter (``LlamaModel.generate_extra_tensors``) stores
    ``inv_freq / inv_freq_llama3`` instead of the parameters; Meta's Llama 3.1+ releases
    all use ``low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192``
    and the largest divisor is ``factor``. We rebuild the divisors from those values and
    accept them only if they match the file.
    """
    from engine.common.config import RopeConfig
    from engine.layers.rope import inv_freq

    rope = RopeConfig(
        theta=config["rope_theta"],
        rope_type="llama3",
        factor=float(factors.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    base = inv_freq(RopeConfig(theta=rope.theta), config["head_dim"])
    rebuilt = (base / inv_freq(rope, config["head_dim"])).numpy()
    if rebuilt.shape != factors.shape or not np.allclose(rebuilt, factors, rtol=1e-4):
        raise UnsupportedConfig(
            f"{gguf_path}: its rope_freqs tensor is not Llama 3 RoPE scaling; convert the "
            "original Hugging Face checkpoint instead"
        )
    return {
        "rope_type": "llama3",
        "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
    }


# llama.cpp's recommended-sampling metadata (gguf-py ``Keys.General.SAMPLING_*``) ->
# generation_config.json fields; the service takes them as the defaults of unset
# request fields (service.api.sampling_defaults).
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_fields(reader: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = field(reader, key)
        if value is not None:
            # GGUF stores float32: 0.2 reads back as 0.20000000298...
            fields[name] = int(value) if name == "top_k" else round(float(value), 6)
    if fields:
        fields["do_sample"] = True  # transformers' GenerationConfig wants it with them
    return fields
