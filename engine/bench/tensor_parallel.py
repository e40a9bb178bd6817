"""Tensor parallel against one GPU, side by side: decode tokens/s at batch 1 and 64, and
the prefill of one 8k-token prompt, for TP=1 and TP=N in one run (random weights of a
real shape, ``load_format="dummy"``). Each row says whether its decode replayed CUDA
graphs (the default, on every rank under TP) or ran eagerly (``--no-cuda-graphs``);
``--also-eager`` adds TP=N eager for comparison.

    python -m engine.bench.tensor_parallel --shape qwen3-8b --tp 2 --also-eager

Needs N CUDA devices; each engine is freed before the next starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile

import torch

from engine.bench.model_shapes import write_shape
from engine.bench.speed import LONG_PREFILL_TOKENS, engine_speed
from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.worker.tp_launch import parallel_engine

DECODE_BATCHES = (1, 64)


def measure(engine: Engine, *, prompt_tokens: int, new_tokens: int, seed: int = 0) -> dict[str, float]:
    """``{"decode b1", "decode b64", "prefill 8k"}`` tokens/s of ``engine`` (after one
    warm-up run of each)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    row: dict[str, float] = {}
    for batch in DECODE_BATCHES:
        prompts = [torch.randint(10, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(batch)]
        engine_speed(engine, prompts, 4)  # warm-up
        row[f"decode b{batch}"] = engine_speed(engine, prompts, new_tokens).decode_tok_s
    long = [torch.randint(10, vocab, (LONG_PREFILL_TOKENS,), generator=g).tolist()]
    engine_speed(engine, long, 2)
    row["prefill 8k"] = engine_speed(engine, long, 2).prefill_tok_s
    return row


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _label(tp: int, engine: Engine) -> str:
    graphs = engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    return f"TP={tp} ({'CUDA graphs' if graphs else 'eager'})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="decode replays CUDA graphs (on every rank under TP); --no-cuda-graphs runs it eagerly")
    ap.add_argument("--also-eager", action="store_true", help="add a TP=N row with --no-cuda-graphs")
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix=f"headroom-bench-tp-{args.shape}-")
    write_shape(args.shape, folder)
    config = EngineConfig(model=folder, device=args.device, load_format="dummy",
                          max_model_len=LONG_PREFILL_TOKENS + 256, cuda_graphs=args.cuda_graphs,
                          tp_cuda_graphs=args.cuda_graphs)
    measure_args = dict(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    rows: dict[str, dict[str, float]] = {}
    engine = Engine(config)
    row = measure(engine, **measure_args)
    rows[_label(1, engine)] = row
    del engine
    _free()
    runs = [config] + ([dataclasses.replace(config, cuda_graphs=False)] if args.also_eager and args.cuda_graphs else [])
    for cfg in runs:
        with parallel_engine(dataclasses.replace(cfg, tensor_parallel_size=args.tp)) as engine:
            row = measure(engine, **measure_args)
            rows[_label(args.tp, engine)] = row
        _free()
    names = list(next(iter(rows.values())))
    print(f"{args.shape}, tokens/s   " + "  ".join(f"{n:>12}" for n in names))
    for label, row in rows.items():
        print(f"{label:<23}" + "  ".join(f"{row[n]:12.1f}" for n in names))


if __name__ == "__main__":
    main()
