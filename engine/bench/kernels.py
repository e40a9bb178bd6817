"""Micro-benchmark of the Triton kernels against their eager torch references on CUDA.

``python -m engine.bench.kernels [--iters N]`` prints, per kernel and shape, the time per call
in microseconds three ways: the torch reference launched eagerly, the Triton kernel
launched eagerly (both include launch cost, what an uncaptured decode step pays), and
each replayed from a CUDA graph (device time alone, what a captured step pays). The
sampler rows compare the per-request CPU-semantics sampler run on CUDA with the device
sampler, eager only (the first reads values back to the host).
"""

from __future__ import annotations

import argparse
import functools
import traceback
from collections.abc import Callable

import torch

from engine.sampling import sampler as sampler_mod
from engine.sampling.sampler import Sampler
from engine.sampling.state import SamplingState
from engine.wire.messages import SamplingParams
from kernels.activation import reference as activation
from kernels.activation import triton_kernel as triton_activation
from kernels.norm import reference as rms_norm
from kernels.norm import triton_kernel as triton_norm
from kernels.rotary import reference as rotary
from kernels.rotary import triton_kernel as triton_rotary

_GRAPH_CALLS = 20


def _eager_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _graph_us(fn: Callable[[], object], iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(_GRAPH_CALLS):
            fn()
    reps = max(1, iters // _GRAPH_CALLS)
    return _eager_us(graph.replay, reps) / _GRAPH_CALLS


def _row(name: str, ref: Callable, tri: Callable, iters: int, graph: bool = True) -> str:
    cells = [_eager_us(ref, iters), _eager_us(tri, iters)]
    if graph:
        cells += [_graph_us(ref, iters), _graph_us(tri, iters)]
    return f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + (" |" if graph else " | - | - |")


def run(iters: int) -> list[str]:
    dev, bf16 = "cuda", torch.bfloat16
    lines = [
        "| kernel (shape) | torch eager us | triton eager us | torch graph us | triton graph us |",
        "|---|---|---|---|---|",
    ]
    for tokens, hidden in ((1, 1024), (64, 1024), (64, 4096), (2048, 4096)):
        x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
        res = torch.randn_like(x)
        w = torch.randn(hidden, device=dev, dtype=bf16)
        lines.append(_row(
            f"add + RMSNorm ({tokens}x{hidden})",
            lambda x=x, r=res, w=w: rms_norm.fused_add_rms_norm(x, r, w, 1e-6),
            lambda x=x, r=res, w=w: triton_norm.fused_add_rms_norm(x, r, w, 1e-6),
            iters,
        ))
    for tokens, inter in ((1, 3072), (64, 3072), (64, 14336)):
        x = torch.randn(tokens, 2 * inter, device=dev, dtype=bf16)
        lines.append(_row(
            f"SiLU-and-mul ({tokens}x{inter})",
            lambda x=x: activation.silu_and_mul(x),
            lambda x=x: triton_activation.silu_and_mul(x),
            iters,
        ))
    from engine.common.config import RopeConfig
    from engine.layers.rope import build_cos_sin_cache

    for label, hq, hk, d, norm in (("Qwen3-0.6B", 16, 8, 128, True), ("Llama-3-8B", 32, 8, 128, False)):
        cache = build_cos_sin_cache(RopeConfig(theta=1e6), d, 4096, dev)
        for tokens in (1, 64, 2048):
            qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=dev, dtype=bf16)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
            kc = torch.zeros(8192, hk, d, device=dev, dtype=bf16)
            vc = torch.zeros_like(kc)
            pos = torch.randint(0, 4096, (tokens,), device=dev)
            slots = torch.randperm(8192, device=dev)[:tokens]
            qw = torch.randn(d, device=dev, dtype=bf16) if norm else None
            kw = torch.randn(d, device=dev, dtype=bf16) if norm else None
            args = (q, k, v, pos, cache, kc, vc, slots, qw, kw, 1e-6)
            lines.append(_row(
                f"{'q/k norm + ' if norm else ''}rotary + KV store, {label} ({tokens} tok)",
                lambda a=args: rotary.rotary_and_store(*a),
                lambda a=args: triton_rotary.rotary_and_store(*a),
                iters,
            ))
    vocab = 151936
    for rows, sp in (
        (1, SamplingParams(temperature=0.0)),
        (64, SamplingParams(temperature=0.0)),
        (1, SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
        (64, SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=1)),
        (64, SamplingParams(temperature=0.8, frequency_penalty=0.3, seed=1)),
    ):
        logits = torch.randn(rows, vocab, device=dev) * 4
        states = [SamplingState(sp, [1, 2, 3], vocab, dev) for _ in range(rows)]
        params = [sp] * rows
        sampler = Sampler()

        def cpu_semantics(s=sampler, lg=logits, st=states, p=params):
            orig = sampler_mod.use_triton
            sampler_mod.use_triton = lambda t: False
            try:
                return s.sample(lg, st, p).tolist()
            finally:
                sampler_mod.use_triton = orig

        kind = "greedy" if sp.greedy else ("penalties" if sp.frequency_penalty else "top-k/p/min-p")
        lines.append(_row(
            f"sample {rows} rows, {kind}, V={vocab} (incl. read-back)",
            cpu_semantics,
            lambda s=sampler, lg=logits, st=states, p=params: s.sample(lg, st, p).tolist(),
            max(iters // 10, 10),
            graph=False,
        ))
    return lines


def _decode_batch(batch_size: int, context: int, page_size: int, device: str):
    from engine.common.forward_batch import ForwardBatch

    pages_per_seq = context // page_size + 1
    table = torch.arange(1, 1 + batch_size * pages_per_seq, device=device).view(batch_size, pages_per_seq)
    pos = torch.full((batch_size,), context, dtype=torch.int64, device=device)
    return ForwardBatch(
        is_decode=True,
        input_ids=torch.randint(0, 1000, (batch_size,), device=device),
        positions=pos,
        out_slots=table[:, context // page_size] * page_size + context % page_size,
        page_table=table,
        prefix_lens=torch.full((batch_size,), context, dtype=torch.int64),
        extend_lens=torch.ones(batch_size, dtype=torch.int64),
        logits_indices=torch.arange(batch_size, device=device),
    )


def model_rows(iters: int) -> list[str]:
    """Decode step of the Qwen3-0.6B shape (random weights, bf16, torch attention over
    the paged pool, context 512), fused Triton kernels against the torch references,
    eager and, where the step captures, as a CUDA graph."""
    import tempfile

    from engine.bench.model_shapes import write_shape
    from engine.kvcache.pool import KVPool
    from engine.layers.attention.torch_backend import TorchAttentionBackend
    from engine.loader.load import load_model
    from kernels.switches import using

    with tempfile.TemporaryDirectory() as tmp:
        model, cfg = load_model(write_shape("qwen3-0.6b", tmp), "cuda", torch.bfloat16, load_format="dummy")
    lines = ["| Qwen3-0.6B decode step (ctx 512) | torch eager ms | triton eager ms | torch graph ms | triton graph ms |",
             "|---|---|---|---|---|"]
    for batch_size in (1, 64):
        batch = _decode_batch(batch_size, 512, 16, "cuda")
        pool = KVPool(num_layers=cfg.num_layers, num_pages=batch_size * 33 + 2, page_size=16,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16,
                      device="cuda")
        attn = TorchAttentionBackend(pool, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                     scale=cfg.head_dim**-0.5)
        attn.prepare(batch)
        attn.prepare = lambda b: None  # metadata once; the step is what is timed
        cells = {}
        for kind in ("torch", "triton"):
            with using(kernels="auto" if kind == "triton" else "torch"):  # --kernels torch: the references
                step = functools.partial(model, batch, attn)
                cells[f"{kind} eager"] = _eager_us(step, max(iters // 10, 10)) / 1000
                try:
                    cells[f"{kind} graph"] = _graph_us(step, max(iters // 2, 20)) / 1000
                except RuntimeError as e:  # a backend op that cannot be captured
                    cells[f"{kind} graph"] = float("nan")
                    print(f"graph capture failed ({kind}): {str(e).splitlines()[0]}")
        order = ("torch eager", "triton eager", "torch graph", "triton graph")
        lines.append(f"| batch {batch_size} | " + " | ".join(f"{cells[k]:.3f}" for k in order) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    from engine.common import environment
    from kernels.switches import configure

    try:  # the kernel switches as serve reads them (HEADROOM_PDL=0 ...)
        configure(environment.kernel_switches())
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("engine.bench.kernels needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for line in run(args.iters):
        print(line, flush=True)
    try:
        for line in model_rows(args.iters):
            print(line, flush=True)
    except Exception:  # the kernel table above stands on its own
        traceback.print_exc()


if __name__ == "__main__":
    main()
