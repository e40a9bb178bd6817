"""Random-weight GGUF files of a model's shape, laid out as llama.cpp's quantized files
are: a dense model's projections in Q4_K/Q6_K (:func:`write_random_gguf`), a mixture
of experts' routed experts in the types of :data:`MOE_EXPERT_TYPES`
(:func:`write_random_moe_gguf`). The quantization benchmarks load them, and the tests
use them as fixtures of real layout and small size."""

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

    Raises:
        ValueError: the hidden or expert size is not whole blocks of the types.
    """
    import gguf

    from engine.loader.default_model import default_gguf_path
    from kernels.quant.synthetic import random_blocks

    source = gguf.GGUFReader(tokenizer_gguf or default_gguf_path())
    tokens = len(source.fields["tokenizer.ggml.tokens"].data)
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    q, kv, hd = config.q_size, config.kv_size, config.head_dim
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(h)
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
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
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
        for name, size in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            writer.add_tensor(p + name + ".weight", np.ones(size, dtype=np.float32))
        for name, kind, rows, cols in (("attn_q", "Q4_K", q, h), ("attn_k", "Q4_K", kv, h),
                                       ("attn_v", "Q6_K", kv, h), ("attn_output", "Q4_K", h, q)):
            add(p + name + ".weight", kind, rows, cols)
        writer.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((e, h), dtype=np.float32) * 0.02)
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
