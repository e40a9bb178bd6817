"""Where a step's time goes, for ``python -m engine.bench.quant --profile`` and
``--profile-prefill TOKENS``: the kernels of eager batch-1 decode steps, and one
prompt's prefill as wall time against the GPU's busy time, its kernels, and the same
prefill replayed from the engine's prefill graph (:mod:`engine.core.prefill_graphs`).
CUDA only; the model is any ``CausalLM`` loaded on it."""

from __future__ import annotations

import time

import torch


def _one_sequence_backend(model, config, pages: int):
    """The Triton attention backend over a CUDA KV pool of ``pages`` 16-token pages in the
    model's dtype, for one sequence (the profiles below)."""
    from engine.kvcache.pool import KVPool
    from engine.layers.attention.registry import create_attention_backend

    pool = KVPool(num_layers=config.num_layers, num_pages=pages, page_size=16, num_kv_heads=config.num_kv_heads,
                  head_dim=config.head_dim, dtype=model.model.embed_tokens.weight.dtype, device="cuda")
    return create_attention_backend("triton", pool, num_heads=config.num_heads, head_dim=config.head_dim,
                                    scale=config.head_dim**-0.5, max_batch=1)


def profile_rows(model, config, context: int, steps: int = 5) -> list[str]:
    """Per-kernel GPU time of ``steps`` eager decode steps at batch 1 (torch.profiler),
    the largest first, with each kernel's share of the total."""
    from torch.profiler import ProfilerActivity, profile

    from engine.bench.kernels import _decode_batch

    attn = _one_sequence_backend(model, config, context // 16 + 4)
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


def prefill_profile_rows(model, config, tokens: int, steps: int = 3) -> list[str]:
    """Where one prompt's prefill of ``tokens`` tokens goes (torch.profiler): wall ms a
    prefill against the GPU's busy ms (kernel time summed) and the kernels launched; a
    wall far above the busy time is the host's (launches, Python), else the kernels',
    the largest listed with their share."""
    from torch.profiler import ProfilerActivity, profile

    from engine.core.profile import profile_batch

    pages = tokens // 16 + 4
    attn = _one_sequence_backend(model, config, pages)
    batch = profile_batch(tokens, 1, tokens, 16, pages, "cuda")
    attn.prepare(batch)
    for _ in range(2):
        model(batch, attn)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        model(batch, attn)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(batch, attn)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.device_time_total for e in events) / steps
    launches = sum(e.count for e in events) // steps
    events.sort(key=lambda e: -e.device_time_total)
    replay = _prefill_replay_seconds(model, attn, tokens, pages, steps)
    rows = [f"prefill of {tokens} tokens: {wall * 1e3:.2f} ms wall, GPU busy {busy / 1e3:.2f} ms, {launches} kernels; "
            f"replayed from a CUDA graph (engine.core.prefill_graphs) {replay * 1e3:.2f} ms",
            "| kernel | calls/prefill | us/prefill | share of busy |", "|---|---|---|---|"]
    rows += [f"| {e.key[:70]} | {e.count // steps} | {e.device_time_total / steps:.1f} | "
             f"{e.device_time_total / steps / busy:.0%} |" for e in events[:12]]
    return rows


def _prefill_replay_seconds(model, attn, tokens: int, pages: int, steps: int) -> float:
    """Wall seconds a prefill of ``tokens`` takes replayed from the engine's one-sequence
    prefill graph (:class:`engine.core.prefill_graphs.PrefillGraphs`), inputs uploaded
    each time as the engine does."""
    from types import SimpleNamespace

    from engine.core.prefill_graphs import PrefillGraphs

    graphs = PrefillGraphs(model, attn, torch.device("cuda"), page_size=16, max_tokens=tokens,
                           max_context_tokens=pages * 16)
    graphs.capture_all()
    ids = list(range(1, tokens + 1))
    req = SimpleNamespace(pages=list(range(1, pages)), all_ids=ids)
    item = SimpleNamespace(req=req, start=0, num_tokens=tokens, scores=False)
    graphs.run([item])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graphs.run([item])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps
