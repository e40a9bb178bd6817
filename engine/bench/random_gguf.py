"""Random-weight GGUF files of a model's shape, laid out as llama.cpp's quantized files
are: a dense model's projections in Q4_K/Q6_K (:func:`write_random_gguf`), a mixture
of experts' routed experts in the types of :data:`MOE_EXPERT_TYPES`
(:func:`write_random_moe_gguf`, Qwen3-MoE or the Qwen3.5/3.6 hybrid). The quantization
benchmarks load them, and the tests use them as fixtures of real layout and small size."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from engine.common.units import GiB


def write_random_gguf(path: Path, config, rng: np.random.Generator) -> None:
    """A random GGUF of ``config`` (a :class:`engine.common.config.ModelConfig` of a Llama
    layout), projections in Q4_K/Q6_K. One random tensor per (type, shape) is shared by
    all layers: the file still holds every layer's copy, so the device reads each."""
    import gguf

    from kernels.quant.synthetic import random_blocks

    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    cache: dict[tuple[str, int, int], np.ndarray] = {}

    def blocks(kind: str, rows: int, cols: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        key = (kind, rows, cols)
        if key not in cache:
            cache[key] = random_blocks(kind, rows, cols, rng, scale=1e-4)
        return cache[key], gguf.GGMLQuantizationType[kind]

    writer = gguf.GGUFWriter(str(path), "llama")
    norm = np.ones(h, dtype=np.float32)
    embd = (rng.standard_normal((config.vocab_size, h), dtype=np.float32) * 0.02).astype(np.float16)
    writer.add_tensor("token_embd.weight", embd)
    layout = {"attn_q": ("Q4_K", q, h), "attn_k": ("Q4_K", kv, h), "attn_v": ("Q6_K", kv, h),
              "attn_output": ("Q4_K", h, q), "ffn_gate": ("Q4_K", i, h), "ffn_up": ("Q4_K", i, h),
              "ffn_down": ("Q6_K", h, i)}
    for layer in range(config.num_layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", norm)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", norm)
        for stem, (kind, rows, cols) in layout.items():
            data, qtype = blocks(kind, rows, cols)
            writer.add_tensor(f"blk.{layer}.{stem}.weight", data, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", norm)
    if not config.tie_word_embeddings:
        data, qtype = blocks("Q6_K", config.vocab_size, h)
        writer.add_tensor("output.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A Q4_K_M file's types (llama.cpp's ``llama_tensor_get_type``, simplified): Q6_K for
# v, down and the LM head, Q4_K elsewhere; routed experts the same per projection.
MOE_EXPERT_TYPES = ("Q4_K", "Q4_K", "Q6_K")


def write_random_moe_gguf(path: Path, config, rng: np.random.Generator, *, tokenizer_gguf: Path | None = None,
                          expert_types: tuple[str, str, str] = MOE_EXPERT_TYPES) -> None:
    """A random ``qwen3moe`` GGUF of ``config`` (a :class:`engine.common.config.ModelConfig` of a
    Qwen3-MoE layout, every layer sparse), laid out as llama.cpp writes one: attention in
    Q4_K (v in Q6_K), each layer's experts stacked in ``ffn_gate_exps``/``ffn_up_exps``/
    ``ffn_down_exps`` of ``expert_types``, the router and norms F32, the embeddings F16,
    the LM head Q6_K. The metadata and tokenizer keys (copied from ``tokenizer_gguf``,
    default the embedded default model's, whose vocabulary then sizes the model) let
    ``headroom serve --model`` convert and serve it. One random stack of expert blocks
    per (type, shape) is shared by all layers (the file still holds each layer's copy).

    A hybrid ``config`` (Qwen3.5/3.6-MoE) is written as a ``qwen35moe`` file: its
    linear-attention layers' ``attn_qkv``/``attn_gate``/``ssm_out`` in Q4_K, the rest of
    them F32 (``ssm_a`` negative, norms as llama.cpp stores them, ``1 + w``), its
    full-attention layers' ``attn_q`` holding the output gate too, a shared expert in
    Q4_K (down Q6_K) behind its F32 gate.

    Raises:
        ValueError: the hidden or expert size is not whole blocks of the types; a hybrid
            other than Qwen3.5/3.6.
    """
    import gguf

    from engine.loader.default_model import default_gguf_path
    from engine.loader.gguf_tokenizer import copy_tokenizer_fields
    from kernels.quant.synthetic import random_blocks

    source = gguf.GGUFReader(tokenizer_gguf or default_gguf_path())
    tokens = len(source.fields["tokenizer.ggml.tokens"].data)
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    q, kv, hd = config.q_size, config.kv_size, config.head_dim
    hybrid = config.is_hybrid
    if hybrid and not config.architecture.startswith("Qwen3_5Moe"):
        raise ValueError(f"{config.architecture}: the hybrid files written here are Qwen3.5/3.6-MoE's (qwen35moe)")
    writer = gguf.GGUFWriter(str(path), "qwen35moe" if hybrid else "qwen3moe")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(h)
    if not hybrid:
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_vocab_size(tokens)
    writer.add_expert_count(e)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(i)
    if hybrid:
        _add_hybrid_metadata(writer, config)
    copy_tokenizer_fields(source, writer)
    cache: dict[tuple, np.ndarray] = {}

    def blocks(kind: str, *shape: int) -> np.ndarray:
        if (kind, shape) not in cache:
            stack = [random_blocks(kind, shape[-2], shape[-1], rng, scale=1e-4) for _ in range(shape[0])]
            cache[(kind, shape)] = np.stack(stack)
        return cache[(kind, shape)]

    def add(name: str, kind: str, *shape: int) -> None:
        data = blocks(kind, *((1,) * (len(shape) == 2) + shape))
        writer.add_tensor(name, data[0] if len(shape) == 2 else data, raw_dtype=gguf.GGMLQuantizationType[kind])

    writer.add_tensor("token_embd.weight", (rng.standard_normal((tokens, h), dtype=np.float32) * 0.02).astype(np.float16))
    for layer in range(config.num_layers):
        p = f"blk.{layer}."
        linear = hybrid and config.layer_types[layer] == "linear_attention"
        norms = (("attn_norm", h), ("post_attention_norm" if hybrid else "ffn_norm", h))
        if not linear:
            norms += (("attn_q_norm", hd), ("attn_k_norm", hd))
        for name, size in norms:
            writer.add_tensor(p + name + ".weight", np.ones(size, dtype=np.float32))
        if linear:
            _add_linear_attention(writer, add, p, config, rng)
        else:
            for name, kind, rows, cols in (("attn_q", "Q4_K", 2 * q if hybrid else q, h), ("attn_k", "Q4_K", kv, h),
                                           ("attn_v", "Q6_K", kv, h), ("attn_output", "Q4_K", h, q)):
                add(p + name + ".weight", kind, rows, cols)
        writer.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((e, h), dtype=np.float32) * 0.02)
        if config.shared_expert_intermediate_size:
            s = config.shared_expert_intermediate_size
            for name, kind, rows, cols in (("ffn_gate_shexp", "Q4_K", s, h), ("ffn_up_shexp", "Q4_K", s, h),
                                           ("ffn_down_shexp", "Q6_K", h, s)):
                add(p + name + ".weight", kind, rows, cols)
            writer.add_tensor(p + "ffn_gate_inp_shexp.weight", rng.standard_normal(h, dtype=np.float32) * 0.02)
        for stem, kind, rows, cols in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), expert_types,
                                          (i, i, h), (h, h, i), strict=True):
            add(p + stem + ".weight", kind, e, rows, cols)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    if not config.tie_word_embeddings:
        add("output.weight", "Q6_K", tokens, h)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_hybrid_metadata(writer, config) -> None:
    """llama.cpp's ``qwen35moe`` keys beyond a Qwen3-MoE file's: the Gated DeltaNet's
    (``ssm.*``), the partial rotary and its multimodal sections, the shared expert's
    width."""
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(config.layer_types.index("full_attention") + 1)
    writer.add_rope_dimension_count(config.rotary_dim or config.head_dim)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _add_linear_attention(writer, add, prefix: str, config, rng: np.random.Generator) -> None:
    """One Gated DeltaNet layer's tensors, under llama.cpp's names (``add(name, kind,
    rows, cols)`` writes random blocks)."""
    h, hv = config.hidden_size, config.linear_num_value_heads
    value = hv * config.linear_value_head_dim
    conv = 2 * config.linear_num_key_heads * config.linear_key_head_dim + value
    add(prefix + "attn_qkv.weight", "Q4_K", conv, h)
    add(prefix + "attn_gate.weight", "Q4_K", value, h)
    add(prefix + "ssm_out.weight", "Q4_K", h, value)
    for name in ("ssm_beta", "ssm_alpha"):
        writer.add_tensor(prefix + name + ".weight", rng.standard_normal((hv, h), dtype=np.float32) * 0.02)
    writer.add_tensor(prefix + "ssm_conv1d.weight",
                      rng.standard_normal((conv, config.linear_conv_kernel_dim), dtype=np.float32) * 0.1)
    writer.add_tensor(prefix + "ssm_a", -np.ones(hv, dtype=np.float32))
    writer.add_tensor(prefix + "ssm_dt.bias", np.ones(hv, dtype=np.float32))
    writer.add_tensor(prefix + "ssm_norm.weight", np.ones(config.linear_value_head_dim, dtype=np.float32))


def write_shape_gguf(path: Path, shape: str, layers: int | None) -> None:
    """A random GGUF of the model shape ``shape`` (:mod:`engine.bench.model_shapes`),
    ``layers`` of them when given, at ``path`` (``--write-gguf``)."""
    from engine.bench.model_shapes import write_shape
    from engine.loader.hf_config import load_model_config

    with tempfile.TemporaryDirectory() as tmp:
        overrides = {} if layers is None else {"num_hidden_layers": layers}
        config = load_model_config(write_shape(shape, Path(tmp) / "cfg", **overrides))
    if config.is_moe:
        write_random_moe_gguf(path, config, np.random.default_rng(0))
    else:
        write_random_gguf(path, config, np.random.default_rng(0))
    print(f"wrote {path}: {shape}, {config.num_layers} layers, {path.stat().st_size / GiB:.2f} GiB")
