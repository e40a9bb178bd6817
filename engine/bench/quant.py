"""Decode speed of a GGUF kept in block format on CUDA, against the same shape in bfloat16.

``python -m engine.bench.quant [--shape llama-3.1-8b] [--batches 1,16] [--context 256]``
writes a random-weight GGUF of a shape from :mod:`engine.bench.model_shapes` with
gguf's writer, laid out as a Q4_K_M file is (q/k/o/gate/up in Q4_K; v, down and the LM
head in Q6_K; the embeddings in F16, which the loader dequantizes to bfloat16 either
way), loads it with its projections in blocks, and times one decode step (Triton
attention, one CUDA graph per batch size, ``--context`` tokens of KV per sequence).
Then the same shape with bfloat16 weights (random, ``load_format="dummy"``); with
``--fp8``, those with an FP8 KV cache, and the shape with FP8 projections
(``quantization="fp8"``: ``torch._scaled_mm`` with per-token activation scales).
Q4_K/Q6_K decode rows run on the int8-activation GEMV (:mod:`kernels.quant.triton_int8`)
unless ``HEADROOM_QUANT_INT8=0``; ``--float-gemv`` then times the float GEMV too, and
``--variants`` every kernel choice (the int8 GEMV's activations quantized by a launch of
their own first, or by the norm or SiLU-and-mul kernel that writes them where one does,
the default, ``HEADROOM_QUANT_INT8_PRODUCER=0`` to turn off; or inside the GEMV,
``HEADROOM_QUANT_INT8_FUSE=1``; q/k/v's Q4_K and Q6_K parts in one launch, the default,
or one each, ``HEADROOM_QUANT_INT8_PARTS=0``). The kernel switches (:mod:`kernels.switches`)
are read from their ``HEADROOM_*`` variables as serve reads them
(:func:`engine.common.environment.kernel_switches`); the variants set them in turn.

Per row: weights' VRAM, step time, tokens/s, and the share of the HBM roofline: the
bytes one step must read (every weight but the embedding table, which a step only
gathers rows of, plus the KV cache) over the measured device-to-device copy bandwidth
(bytes read plus bytes written per second). It also prints the dequantize-GEMV alone on
the shape's projections at one row, with the same roofline share.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.common.units import GiB
from engine.common import environment
from kernels.switches import configure, current, using

_GRAPH_REPLAYS = 50


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


def copy_bandwidth(nbytes: int = GiB) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1000)


def _graph_seconds(fn, replays: int = _GRAPH_REPLAYS) -> float:
    from engine.bench.kernels import _graph_us

    return _graph_us(fn, replays * 20) / 1e6


def step_bytes(model: torch.nn.Module, config, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """Bytes a decode step reads: the weights but the embedding table (unless tied, then
    it is the LM head), plus ``batch * context`` tokens of KV."""
    from engine.layers.linear.gguf_blocks import model_weight_bytes

    weights = model_weight_bytes(model)
    if not config.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.nbytes
    return weights + batch * context * kv_bytes_per_token


def decode_rows(model, config, batches: list[int], context: int, bandwidth: float, label: str,
                kv_cache_dtype: str = "auto") -> list[str]:
    from engine.layers.attention.base import create_attention_backend
    from engine.bench.kernels import _decode_batch
    from engine.kvcache.pool import KVPool, kv_storage_dtype
    from engine.core.footprint import kv_bytes_per_token
    from engine.layers.linear.gguf_blocks import model_weight_bytes

    dtype = model.model.embed_tokens.weight.dtype
    kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
    kv_token = kv_bytes_per_token(config, kv_dtype)
    rows = []
    for b in batches:
        page = 16
        pool = KVPool(num_layers=config.num_layers, num_pages=b * (context // page + 1) + 2, page_size=page,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=kv_dtype, device="cuda",
                      compute_dtype=dtype)
        attn = create_attention_backend("triton", pool, num_heads=config.num_heads, head_dim=config.head_dim,
                                        scale=config.head_dim**-0.5, max_batch=max(batches))
        batch = _decode_batch(b, context, page, "cuda")
        attn.prepare(batch)
        attn.prepare = lambda _b: None  # metadata once; the step is what is timed
        # Fewer replays for larger batches (their steps are longer; same precision).
        seconds = _graph_seconds(lambda m=model, bt=batch, a=attn: m(bt, a), max(3, _GRAPH_REPLAYS // b))
        moved = step_bytes(model, config, b, context, kv_token)
        share = moved / seconds / bandwidth
        rows.append(f"| {label} | {b} | {model_weight_bytes(model) / GiB:.2f} | {seconds * 1e3:.3f} | "
                    f"{b / seconds:,.0f} | {moved / GiB:.2f} | {share:.0%} |")
        del pool, attn
        torch.cuda.empty_cache()
    return rows


def set_q6k_layout(model: torch.nn.Module, repacked: bool) -> None:
    """Every Q6_K part of ``model``'s quantized projections in the repacked layout
    (:mod:`kernels.quant.repack`, what the loader makes on CUDA) or back in GGUF's, in
    place: the two layouts timed on one loaded model."""
    from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear
    from kernels.quant.repack import planes_to_q6k

    for mod in model.modules():
        if not isinstance(mod, QuantLinear):
            continue
        if repacked:
            mod.repack_for_kernels()
            continue
        for i, (spec, w) in enumerate(mod.part_views()):
            if spec.type_name == "Q6_K_P":
                planes_to_q6k(w, out=w)
                mod.parts[i] = PartSpec(spec.rows, "Q6_K")


# The GEMV choices --variants times: (label, int8 GEMV, its activations quantized apart
# from it (not inside it), a projection's Q4_K and Q6_K parts in one launch, activations
# quantized apart by the norm or SiLU-and-mul that writes them where one does rather
# than by a launch of their own).
_GEMV_VARIANTS = (("float GEMV", False, False, False, False),
                  ("int8 GEMV, x quantized apart, a launch a part", True, True, False, False),
                  ("int8 GEMV, x quantized apart, a launch a projection", True, True, True, False),
                  ("int8 GEMV, x quantized by its norm/SiLU (o's apart), a launch a projection", True, True, True, True),
                  ("int8 GEMV, x quantized in it, a launch a part", True, False, False, False),
                  ("int8 GEMV, x quantized in it, a launch a projection", True, False, True, False))


def _gemv_switches() -> tuple[bool, bool, bool, bool]:
    """The GEMV switches of :mod:`kernels.switches` in force: ``(quant_int8,
    quant_int8_fuse, quant_int8_parts, quant_int8_producer)``."""
    s = current()
    return s.quant_int8, s.quant_int8_fuse, s.quant_int8_parts, s.quant_int8_producer


def variant_rows(model, config, batches: list[int], context: int, bandwidth: float) -> list[str]:
    """Decode rows of the GGUF model for each kernel choice: Q6_K in GGUF blocks or
    repacked planes, x the float GEMV or the int8-activation GEMV (its activations
    quantized by a launch of their own, by the norm or SiLU-and-mul kernel that writes
    them, or inside the GEMV; a projection of Q4_K and Q6_K parts in a launch a part,
    or in one); then the batches above one with
    every multi-row step on the GEMM (tensor cores, the weights read once) instead of
    the GEMV (the weights read once per row). Each variant runs under its switches
    (:func:`kernels.switches.using`); leaves the model repacked, the switches as they were."""
    from kernels.quant import triton_kernel as triton_quant

    gemv_rows_max = triton_quant.GEMV_MAX_ROWS
    rows = []
    try:
        for repacked in (False, True):
            set_q6k_layout(model, repacked)
            layout = "Q6_K planes" if repacked else "Q6_K blocks"
            for name, use_int8, apart, one_launch, producer in _GEMV_VARIANTS:
                with using(quant_int8=use_int8, quant_int8_fuse=not apart, quant_int8_parts=one_launch,
                           quant_int8_producer=producer):
                    rows += decode_rows(model, config, batches, context, bandwidth, f"GGUF Q4_K/{layout}, {name}")
                print("\n".join(rows[-len(batches):]), flush=True)
            triton_quant.GEMV_MAX_ROWS = 1
            many = [b for b in batches if b > 1]
            if many:
                rows += decode_rows(model, config, many, context, bandwidth, f"GGUF Q4_K/{layout}, GEMM")
                print("\n".join(rows[-len(many):]), flush=True)
            triton_quant.GEMV_MAX_ROWS = gemv_rows_max
    finally:
        triton_quant.GEMV_MAX_ROWS = gemv_rows_max
        set_q6k_layout(model, True)
    return rows


def _rotating(w: torch.Tensor, reach: int = 512 << 20) -> list[torch.Tensor]:
    """Copies of ``w`` adding up to ``reach`` bytes (at least 2), so that back-to-back
    calls cycling through them read HBM rather than the 50 MB L2."""
    return [w] + [w.clone() for _ in range(max(1, -(-reach // w.nbytes) - 1))]


def _gemv_seconds(x: torch.Tensor, w: torch.Tensor, kind: str, replays: int = _GRAPH_REPLAYS, **tiling) -> float:
    from kernels.quant.triton_kernel import quant_gemv

    copies = _rotating(w)
    turn = itertools.cycle(copies)
    return _graph_seconds(lambda: quant_gemv(x, next(turn), kind, **tiling), replays)


def _int8_seconds(x: torch.Tensor, w: torch.Tensor, kind: str, variant: dict, replays: int = 5, **tiling) -> float:
    """As :func:`_gemv_seconds` for the int8 GEMV at a forced tiling and variant, the
    activations' quantization included (inside the GEMV, or in a launch of its own
    first unless the ``quant_int8_fuse`` switch is on)."""
    from kernels.quant.int8_choice import int8_quantize_apart
    from kernels.quant.triton_activations import quantize_activations
    from kernels.quant.triton_int8 import int8_gemv

    turn = itertools.cycle(_rotating(w))
    if int8_quantize_apart():
        return _graph_seconds(lambda: int8_gemv(quantize_activations(x), next(turn), kind, variant=variant, **tiling),
                              replays)
    return _graph_seconds(lambda: int8_gemv(x, next(turn), kind, variant=variant, **tiling), replays)


def gemv_rows(model, bandwidth: float, m: int = 1) -> list[str]:
    """The dequantize-GEMV alone at ``m`` rows on each distinct projection of the model
    (weights rotated through copies so each call reads HBM)."""
    from engine.layers.linear.gguf_blocks import QuantLinear

    seen = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            for spec, w in mod.part_views():
                if spec.type_name is not None:
                    seen.setdefault((spec.type_name, tuple(w.shape), mod.in_features), (name, w))
    rows = []
    for (kind, _, k), (name, w) in sorted(seen.items(), key=lambda kv: kv[1][0]):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        seconds = _gemv_seconds(x, w, kind)
        rows.append(f"| {name.split('.', 3)[-1]} | {kind} | {w.shape[0]}x{k} | {m} | {seconds * 1e6:.1f} | "
                    f"{w.nbytes / seconds / bandwidth:.0%} |")
    return rows


def sweep_rows(bandwidth: float, shapes: list[tuple[str, int, int]]) -> list[str]:
    """The GEMV at one row per projection shape: what the autotuner picked, then its
    tilings (for the int8 GEMV all of them, else the best three and the worst two),
    then the best without the PTX code conversion (the float GEMV) or, for the int8
    GEMV's types, the float GEMV's own tuned pick."""
    import triton

    from kernels.quant import triton_int8
    from kernels.quant import triton_kernel as triton_quant
    from kernels.quant.formats import block_format
    from kernels.quant.int8_choice import int8_quantize_apart, uses_int8_dot
    from kernels.quant.synthetic import random_blocks

    rows = []
    rng = np.random.default_rng(0)
    for kind, n, k in shapes:
        w = torch.from_numpy(random_blocks(kind, n, k, rng, scale=1e-4)).cuda()
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        int8 = uses_int8_dot(kind)
        results = []
        if int8:
            configs = triton_int8._prune(triton_int8._configs(), {"QT": block_format(kind).code,
                                                                  "QUANT_X": not int8_quantize_apart()})
        else:
            configs = triton_quant._prune(triton_quant._gemv_configs(),
                                          {"QK": block_format(kind).block_elements})
        for c in configs:
            tiling = dict(block_n=c.kwargs["BLOCK_N"], blocks_per_step=c.kwargs["KB"], num_warps=c.num_warps, split_k=1)
            split = c.kwargs.get("SPLIT", 0)
            prefetch = c.kwargs.get("PREFETCH", 0)
            try:
                if int8:
                    seconds = _int8_seconds(x, w, kind, {"SPLIT": split, "PREFETCH": prefetch}, **tiling)
                else:
                    seconds = _gemv_seconds(x, w, kind, replays=5, **tiling)
            except (RuntimeError, triton.runtime.errors.OutOfResources) as e:
                print(f"{kind} {n}x{k} {c}: {str(e).splitlines()[0]}")
                continue
            results.append((seconds, f"block_n {c.kwargs['BLOCK_N']}, kb {c.kwargs['KB']}, warps {c.num_warps}"
                            + (f", split {split}, prefetch {prefetch}" if int8 else ", ptx True")))
        results.sort()
        if int8:
            # The best tiling with K split over 2-4 programs a tile (atomics into a
            # zeroed float32 row, then a copy: both launches timed too).
            best = results[0][1]
            tiling = dict(item.split(" ") for item in best.split(", "))
            for split_k in (2, 4):
                seconds = _int8_seconds(x, w, kind, {"SPLIT": int(tiling["split"]), "PREFETCH": int(tiling["prefetch"])},
                                        block_n=int(tiling["block_n"]), blocks_per_step=int(tiling["kb"]),
                                        num_warps=int(tiling["warps"]), split_k=split_k)
                results.append((seconds, f"{best}, split-K {split_k}"))
            other = _gemv_seconds(x, w, kind, replays=5, int8_dot=False)
            results.append((other, "float GEMV, tuned"))
        else:
            label = results[0][1]
            tiling = dict(item.split(" ") for item in label.split(", ")[:3])
            with using(quant_ptx=False):
                other = _gemv_seconds(x, w, kind, replays=5, block_n=int(tiling["block_n"]),
                                      blocks_per_step=int(tiling["kb"]), num_warps=int(tiling["warps"]), split_k=1)
            results.append((other, label.replace("ptx True", "ptx False")))
        default = _gemv_seconds(x, w, kind, replays=5)
        tuned = triton_int8._tuned if int8 else triton_quant._gemv_tuned
        picked = [str(c) for key, c in tuned.cache.items() if n in key and k in key]
        shape_rows = [f"| {kind} {n}x{k} | {'int8 ' if int8 else ''}tuned ({'; '.join(picked)}) | {default * 1e6:.1f} | "
                      f"{w.nbytes / default / bandwidth:.0%} |"]
        for seconds, label in results if int8 else results[:3] + results[-2:]:
            shape_rows.append(f"| {kind} {n}x{k} | {label} | {seconds * 1e6:.1f} | {w.nbytes / seconds / bandwidth:.0%} |")
        print("\n".join(shape_rows), flush=True)
        rows += shape_rows
        del w
    return rows


def gemm_rows(bandwidth: float, shapes: list[tuple[str, int, int]], m: int = 512) -> list[str]:
    """The prefill GEMM at ``m`` rows per projection shape (weights rotated through
    copies), in TFLOP/s and as a share of the roofline of reading the weights once."""
    from kernels.quant.synthetic import random_blocks
    from kernels.quant.triton_kernel import quant_gemm

    rows = []
    rng = np.random.default_rng(1)
    for kind, n, k in shapes:
        w = torch.from_numpy(random_blocks(kind, n, k, rng, scale=1e-4)).cuda()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        turn = itertools.cycle(_rotating(w))
        seconds = _graph_seconds(lambda x=x, turn=turn, kind=kind: quant_gemm(x, next(turn), kind), 5)
        rows.append(f"| {kind} {n}x{k} | {m} | {seconds * 1e6:.1f} | {2 * m * n * k / seconds / 1e12:.1f} | "
                    f"{w.nbytes / seconds / bandwidth:.0%} |")
        print(rows[-1], flush=True)
        del w
    return rows


def profile_rows(model, config, context: int, steps: int = 5) -> list[str]:
    """Per-kernel GPU time of ``steps`` eager decode steps at batch 1 (torch.profiler),
    the largest first, with each kernel's share of the total."""
    from torch.profiler import ProfilerActivity, profile

    from engine.layers.attention.base import create_attention_backend
    from engine.bench.kernels import _decode_batch
    from engine.kvcache.pool import KVPool

    dtype = model.model.embed_tokens.weight.dtype
    pool = KVPool(num_layers=config.num_layers, num_pages=context // 16 + 4, page_size=16,
                  num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype, device="cuda")
    attn = create_attention_backend("triton", pool, num_heads=config.num_heads, head_dim=config.head_dim,
                                    scale=config.head_dim**-0.5, max_batch=1)
    batch = _decode_batch(1, context, 16, "cuda")
    attn.prepare(batch)
    for _ in range(2):
        model(batch, attn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(batch, attn)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    events.sort(key=lambda e: -e.device_time_total)
    rows = [f"| {e.key[:70]} | {e.count // steps} | {e.device_time_total / steps:.1f} | {e.device_time_total / total:.0%} |"
            for e in events[:12]]
    return rows


def _batches(text: str) -> list[int]:
    """``--batches``: comma-separated positive batch sizes."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes (e.g. 1,16)") from None
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes are 1 or more")
    return batches


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


# K-quant blocks hold 256 weights: every row the random file quantizes is whole blocks.
_K_BLOCK = 256


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, what the benchmark cannot do (argparse's one-line
    errors, exit 2): a shape it cannot write, more layers than the shape's, an unusable
    output path, or timing without a GPU."""
    from engine.bench.model_shapes import SHAPES

    shape = SHAPES[args.shape]
    if "linear_num_value_heads" in shape:
        p.error(f"--shape {args.shape}: hybrid (linear-attention) models have no random GGUF writer here; "
                "choose a dense or mixture-of-experts shape")
    if args.layers is not None and args.layers > shape["num_hidden_layers"]:
        p.error(f"--layers {args.layers}: {args.shape} has {shape['num_hidden_layers']} layers; use that many or fewer")
    sizes = {"hidden size": shape["hidden_size"],
             "expert size" if "num_experts" in shape else "intermediate size":
             shape["moe_intermediate_size" if "num_experts" in shape else "intermediate_size"]}
    for what, size in sizes.items():
        if size % _K_BLOCK:
            p.error(f"--shape {args.shape}: its {what} {size} is not a multiple of {_K_BLOCK}, the K-quant block "
                    "the random Q4_K_M-like file is written in; choose another shape")
    if args.write_gguf is not None:
        out = Path(args.write_gguf).expanduser()
        if out.is_dir():
            p.error(f"--write-gguf {out}: is a directory; give a file path ending in .gguf")
        if not out.parent.is_dir():
            p.error(f"--write-gguf {out}: {out.parent} is not an existing folder; create it first")
        existed = out.exists()
        try:
            with open(out, "ab"):
                pass
        except OSError as e:
            p.error(f"--write-gguf {out}: cannot write there ({e.strerror}); choose a writable folder")
        if not existed:
            out.unlink()
    elif not torch.cuda.is_available():
        p.error("times decode steps on a CUDA GPU and finds none here; --write-gguf PATH writes the random GGUF "
                "without one")


def main(argv: list[str] | None = None) -> None:
    from engine.bench.model_shapes import SHAPES, write_shape
    from engine.loader.gguf_quant import gguf_weight_size, load_gguf_quantized
    from engine.loader.hf_config import load_model_config
    from engine.loader.load import load_model
    from kernels import pdl

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES),
                   help="model shape of the random GGUF (default %(default)s)")
    p.add_argument("--layers", type=_positive, default=None, help="fewer layers than the shape's (quick runs)")
    p.add_argument("--batches", type=_batches, default=[1, 16], help="decode batch sizes, e.g. 1,16 (default)")
    p.add_argument("--context", type=_positive, default=256, help="tokens of KV per sequence (default %(default)s)")
    p.add_argument("--dir", default=None, help="where to write the GGUF (default: a temp dir)")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 comparison")
    p.add_argument("--sweep", action="store_true", help="then the GEMV's tilings on the gate/up, down and o shapes")
    p.add_argument("--profile", action="store_true", help="per-kernel times of eager batch-1 decode steps")
    p.add_argument("--variants", action="store_true",
                   help="the GGUF rows for each kernel choice instead: Q6_K blocks or repacked planes, float or "
                        "int8 GEMV (activations quantized apart, by the norm or SiLU-and-mul that writes them, or "
                        "inside the GEMV; q/k/v's parts in one launch or one each), and the GEMM for multi-row "
                        "steps")
    p.add_argument("--float-gemv", action="store_true",
                   help="then the GGUF rows again with Q4_K/Q6_K on the float GEMV")
    p.add_argument("--fp8", action="store_true",
                   help="then FP8 weights (--quantization fp8) and bfloat16 weights with an FP8 KV cache")
    p.add_argument("--write-gguf", default=None, metavar="PATH",
                   help="only write the random GGUF of --shape (and --layers) to PATH, for headroom serve: a "
                        "mixture-of-experts shape as a qwen3moe file with Q4_K/Q4_K/Q6_K experts and the default "
                        "model's tokenizer")
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        configure(environment.kernel_switches())
    except ValueError as e:
        p.error(str(e))
    if args.write_gguf is not None:
        _write_gguf_only(Path(args.write_gguf).expanduser(), args.shape, args.layers)
        return
    batches = args.batches
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
        folder = write_shape(args.shape, Path(tmp) / "cfg", **overrides)
        config = load_model_config(folder)
        path = Path(tmp) / "random-q4_k_m.gguf"
        write_random_gguf(path, config, np.random.default_rng(0))
        bandwidth = copy_bandwidth()
        print(f"{args.shape}, {config.num_layers} layers, context {args.context}; GGUF {path.stat().st_size / GiB:.2f} GiB; "
              f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
        print(f"plan: {gguf_weight_size(path, config, torch.bfloat16).mix}")
        model = load_gguf_quantized(config, path, "cuda", torch.bfloat16)
        print("| weights | batch | VRAM GiB | step ms | tok/s | GiB read/step | roofline share |\n"
              "|---|---|---|---|---|---|---|", flush=True)
        if args.variants:
            variant_rows(model, config, batches, args.context, bandwidth)
        else:
            print("\n".join(decode_rows(model, config, batches, args.context, bandwidth, "GGUF Q4_K/Q6_K")),
                  flush=True)
        if pdl.enabled(torch.device("cuda")):  # the same step launched in stream order
            with using(pdl=False):
                print("\n".join(decode_rows(model, config, batches, args.context, bandwidth,
                                             "GGUF Q4_K/Q6_K, PDL off")), flush=True)
        if args.float_gemv:
            with using(quant_int8=False):
                print("\n".join(decode_rows(model, config, batches, args.context, bandwidth,
                                             "GGUF Q4_K/Q6_K, float GEMV")), flush=True)
        gemv = gemv_rows(model, bandwidth) + gemv_rows(model, bandwidth, m=16)
        if args.profile:
            print("\n| kernel (GGUF, eager batch 1) | calls/step | us/step | share |\n|---|---|---|---|")
            print("\n".join(profile_rows(model, config, args.context)), flush=True)
        del model
        torch.cuda.empty_cache()
        if not args.no_bf16:
            dense, _ = load_model(folder, "cuda", torch.bfloat16, load_format="dummy")
            print("\n".join(decode_rows(dense, config, batches, args.context, bandwidth, "bfloat16")), flush=True)
            if args.profile:
                print("\n| kernel (bfloat16, eager batch 1) | calls/step | us/step | share |\n|---|---|---|---|")
                print("\n".join(profile_rows(dense, config, args.context)), flush=True)
            if args.fp8:
                print("\n".join(decode_rows(dense, config, batches, args.context, bandwidth, "bfloat16, FP8 KV",
                                             kv_cache_dtype="fp8")), flush=True)
            del dense
            torch.cuda.empty_cache()
        if args.fp8:
            fp8, _ = load_model(folder, "cuda", torch.bfloat16, load_format="dummy", quantization="fp8")
            print("\n".join(decode_rows(fp8, config, batches, args.context, bandwidth, "FP8 (scaled_mm)")), flush=True)
            del fp8
            torch.cuda.empty_cache()
    print("\n| projection | type | N x K | rows | GEMV us | roofline share |\n|---|---|---|---|---|---|")
    print("\n".join(gemv), flush=True)
    if args.sweep:
        h, i = config.hidden_size, config.intermediate_size
        print("\n| GEMM shape | rows | us | TFLOP/s | roofline share |\n|---|---|---|---|---|", flush=True)
        gemm_rows(bandwidth, [("Q4_K", 2 * i, h), ("Q6_K_P", h, i), ("Q6_K", h, i)])
        print("\n| GEMV shape | tiling | us | roofline share |\n|---|---|---|---|", flush=True)
        sweep_rows(bandwidth, [("Q4_K", 2 * i, h), ("Q6_K_P", h, i), ("Q4_K", h, h), ("Q4_K", config.q_size + config.kv_size, h),
                               ("Q6_K_P", config.kv_size, h), ("Q6_K_P", config.vocab_size, h)])


def _write_gguf_only(path: Path, shape: str, layers: int | None) -> None:
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


if __name__ == "__main__":
    main()
