"""``headroom bench engine``: prefill and decode speed of the engine against
transformers' ``generate`` on the same model, device and dtype, in one run.

Prompts are random token ids of one length (no padding on either side), outputs are
greedy with EOS ignored, so both sides do exactly the same work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.messages import GenerateRequest, SamplingParams


@dataclass(frozen=True)
class Speed:
    """Tokens per second: ``prefill`` (prompt tokens / time to every first token) and
    ``decode`` (tokens after the first / the time after the first)."""

    prefill_tok_s: float
    decode_tok_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_speed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Speed:
    """Run ``prompts`` together through ``engine``; the prefix cache is cleared first so
    the prompts are computed, not looked up."""
    if engine.radix is not None:
        engine.radix.clear()
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"bench-{i}", prompt_token_ids=ids, sampling=sp))
    _sync(engine.device)
    t0 = time.perf_counter()
    first: set[str] = set()
    t_first = None
    while engine.has_work():
        for out in engine.step():
            if out.token_ids:
                first.add(out.request_id)
        if t_first is None and len(first) == len(prompts):
            _sync(engine.device)
            t_first = time.perf_counter()
    _sync(engine.device)
    t_end = time.perf_counter()
    assert t_first is not None
    prompt_tokens = sum(len(p) for p in prompts)
    return Speed(prompt_tokens / (t_first - t0), len(prompts) * (new_tokens - 1) / max(t_end - t_first, 1e-9))


def transformers_speed(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> Speed:
    """The same work through ``model.generate`` (static batch, its own KV cache)."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        _sync(device)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        _sync(device)
        t2 = time.perf_counter()
    prefill_s = t1 - t0
    decode_s = max((t2 - t1) - prefill_s, 1e-9)
    return Speed(ids.numel() / prefill_s, len(prompts) * (new_tokens - 1) / decode_s)


def run_bench_engine(
    *, model: str | None, device: str, batches: tuple[int, ...], prompt_tokens: int, new_tokens: int, seed: int = 0
) -> list[dict]:
    """Measure both sides at each batch size; returns one row per (batch, side) and prints
    a table. Each side runs once untimed first (warm-up)."""
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(model=model, device=device))
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.dtype).to(engine.device).eval()
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    rows = []
    for b in batches:
        prompts = [torch.randint(10, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(b)]
        engine_speed(engine, prompts, 4)  # warm-up
        transformers_speed(hf, prompts, 4, engine.device)
        ours = engine_speed(engine, prompts, new_tokens)
        theirs = transformers_speed(hf, prompts, new_tokens, engine.device)
        rows.append({"batch": b, "side": "headroom", "prefill_tok_s": ours.prefill_tok_s, "decode_tok_s": ours.decode_tok_s})
        rows.append({"batch": b, "side": "transformers", "prefill_tok_s": theirs.prefill_tok_s, "decode_tok_s": theirs.decode_tok_s})
        rows.append({
            "batch": b, "side": "ratio",
            "prefill_tok_s": ours.prefill_tok_s / theirs.prefill_tok_s,
            "decode_tok_s": ours.decode_tok_s / theirs.decode_tok_s,
        })
    print(f"model {engine.info.model_name} on {engine.info.device} ({engine.info.dtype}), "
          f"prompt {prompt_tokens} tokens, {new_tokens} new tokens, greedy")
    print(f"{'batch':>5}  {'side':<12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r in rows:
        fmt = "{:>14.2f}x {:>12.2f}x" if r["side"] == "ratio" else "{:>14.1f}  {:>12.1f}"
        print(f"{r['batch']:>5}  {r['side']:<12} " + fmt.format(r["prefill_tok_s"], r["decode_tok_s"]))
    return rows
