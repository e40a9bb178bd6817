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

The random GGUF comes from :mod:`engine.bench.random_gguf`; the GEMV and GEMM rows alone
from :mod:`engine.bench.quant_gemv`. This module times the whole decode step and runs
the command.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.bench.quant_gemv import (
    GRAPH_REPLAYS,
    copy_bandwidth,
    gemm_rows,
    gemm_sweep_rows,
    gemv_rows,
    graph_seconds,
    sweep_rows,
)
from engine.bench.quant_profile import prefill_profile_rows, profile_rows
from engine.bench.random_gguf import write_random_gguf, write_shape_gguf
from engine.common import environment
from engine.common.units import GiB
from kernels.switches import configure, current, using


def step_bytes(model: torch.nn.Module, config, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """Bytes a decode step reads: the weights but the embedding table (unless tied, then
    it is the LM head) and the rotary cache (a row a token), plus ``batch * context``
    tokens of KV."""
    from engine.layers.weight_census import model_weight_bytes, rope_cache_bytes

    weights = model_weight_bytes(model) - rope_cache_bytes(model)
    if not config.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.nbytes
    return weights + batch * context * kv_bytes_per_token


def decode_rows(model, config, batches: list[int], context: int, bandwidth: float, label: str,
                kv_cache_dtype: str = "auto") -> list[str]:
    from engine.bench.kernels import _decode_batch
    from engine.core.footprint import kv_bytes_per_token
    from engine.kvcache.pool import KVPool, kv_storage_dtype
    from engine.layers.attention.registry import create_attention_backend
    from engine.layers.weight_census import model_weight_bytes

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
        seconds = graph_seconds(lambda m=model, bt=batch, a=attn: m(bt, a), max(3, GRAPH_REPLAYS // b))
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
            many = [b for b in batches if b > 1]
            if many:
                with using(quant_gemv_rows=1):
                    rows += decode_rows(model, config, many, context, bandwidth, f"GGUF Q4_K/{layout}, GEMM")
                print("\n".join(rows[-len(many):]), flush=True)
    finally:
        set_q6k_layout(model, True)
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

    shape = SHAPES[args.shape].get("text_config", SHAPES[args.shape])  # a vision-language shape nests it
    if "linear_num_value_heads" in shape:
        if not SHAPES[args.shape]["architectures"][0].startswith("Qwen3_5"):
            p.error(f"--shape {args.shape}: hybrid (linear-attention) models other than Qwen3.5/3.6 have no "
                    "random GGUF writer here; choose another shape")
        if args.write_gguf is None:
            p.error(f"--shape {args.shape}: a hybrid (linear-attention) model is not timed here; --write-gguf PATH "
                    "writes its random GGUF (qwen35moe)")
    if args.profile_prefill < 0:
        p.error(f"--profile-prefill {args.profile_prefill}: a prompt of 1 or more tokens, or 0 for none")
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
    p.add_argument("--gemm-sweep", action="store_true",
                   help="first the block GEMM's tilings at 16, 64 and 128 rows on the gate/up, down and o shapes")
    p.add_argument("--profile", action="store_true", help="per-kernel times of eager batch-1 decode steps")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="TOKENS",
                   help="then one prompt's prefill of TOKENS tokens: wall time against the GPU's busy time, and "
                        "its kernels")
    p.add_argument("--variants", action="store_true",
                   help="the GGUF rows for each kernel choice instead: Q6_K blocks or repacked planes, float or "
                        "int8 GEMV (activations quantized apart, by the norm or SiLU-and-mul that writes them, or "
                        "inside the GEMV; q/k/v's parts in one launch or one each), and the GEMM for multi-row "
                        "steps")
    p.add_argument("--int8-gemm", action="store_true",
                   help="then the GGUF rows again with multi-row steps on the int8 tensor-core GEMM "
                        "(--quant-gemm-int8)")
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
        write_shape_gguf(Path(args.write_gguf).expanduser(), args.shape, args.layers)
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
        if args.gemm_sweep:
            h, i = config.hidden_size, config.intermediate_size
            print("\n| GEMM shape | rows | kernel | us | roofline share |\n|---|---|---|---|---|", flush=True)
            gemm_sweep_rows(bandwidth, [("Q4_K", 2 * i, h), ("Q6_K_P", h, i), ("Q4_K", h, h)])
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
        if args.int8_gemm:
            with using(quant_gemm_int8=True):
                print("\n".join(decode_rows(model, config, batches, args.context, bandwidth,
                                             "GGUF Q4_K/Q6_K, int8 GEMM")), flush=True)
        if args.float_gemv:
            with using(quant_int8=False):
                print("\n".join(decode_rows(model, config, batches, args.context, bandwidth,
                                             "GGUF Q4_K/Q6_K, float GEMV")), flush=True)
        gemv = gemv_rows(model, bandwidth) + gemv_rows(model, bandwidth, m=16)
        if args.profile:
            print("\n| kernel (GGUF, eager batch 1) | calls/step | us/step | share |\n|---|---|---|---|")
            print("\n".join(profile_rows(model, config, args.context)), flush=True)
        if args.profile_prefill:
            print("\n" + "\n".join(prefill_profile_rows(model, config, args.profile_prefill)), flush=True)
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


if __name__ == "__main__":
    main()
