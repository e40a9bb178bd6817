"""Hybrid linear-attention models on a GPU: the linear-attention prefill transient the
plan charges against the measured one, and a long prompt through the engine.

    python -m engine.bench.hybrid --layers 8 --experts 64 --device-limit 16GiB --prompt 94000

Builds Qwen3-Next-80B-A3B's shape (``engine.bench.model_shapes``) with fewer layers
and experts, random weights (``load_format="dummy"``), bfloat16.
1. One Gated DeltaNet layer's forward at each chunk: the allocator's peak over what was
   allocated before, against :func:`engine.core.footprint.linear_attention_activation_bytes`.
2. The engine under ``--device-limit`` at the largest chunk: its plan (ledger printed),
   then one prompt of ``--prompt`` tokens to completion.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from engine.bench.model_shapes import write_shape
from engine.common.config import EngineConfig
from engine.common.forward_batch import ForwardBatch
from engine.common.units import parse_size
from engine.core.engine import Engine
from engine.core.footprint import linear_attention_activation_bytes
from engine.kvcache.state_pool import StatePool
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.loader.hf_config import load_model_config
from engine.wire.messages import GenerateRequest, SamplingParams

MiB = 1 << 20


def layer_transient(mc, chunk: int) -> int:
    """Peak bytes one GatedDeltaNet layer's forward allocates over its inputs (bf16)."""
    device = torch.device("cuda")
    layer = GatedDeltaNet(mc, 0).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.A_log.fill_(0.0)
        layer.dt_bias.fill_(1.0)
    states = StatePool(mc, 1, torch.bfloat16, device)
    x = torch.randn(chunk, mc.hidden_size, device=device, dtype=torch.bfloat16)
    batch = ForwardBatch(
        is_decode=False, input_ids=torch.zeros(chunk, dtype=torch.long, device=device),
        positions=torch.arange(chunk, device=device), out_slots=torch.zeros(chunk, dtype=torch.long, device=device),
        page_table=torch.zeros(1, 1, dtype=torch.long, device=device), prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([chunk]), logits_indices=torch.tensor([chunk - 1], device=device),
        state_slots=torch.tensor([1]),
    )
    with torch.no_grad():
        layer(x, batch, states)  # warm-up: Triton compiles and autotunes
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = layer(x, batch, states)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    del out, layer, states, x
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--device-limit", default="16GiB")
    ap.add_argument("--prompt", type=int, default=94000)
    ap.add_argument("--chunks", default="2048,8192")
    args = ap.parse_args()
    folder = write_shape("qwen3-next-80b-a3b", tempfile.mkdtemp(), num_hidden_layers=args.layers,
                         num_experts=args.experts, max_position_embeddings=131072)
    mc = load_model_config(folder)
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"NVIDIA device: {torch.cuda.get_device_name()}; Qwen3-Next-80B-A3B dims, {args.layers} layers "
          f"({len(mc.linear_layers)} linear), {args.experts} experts, bfloat16")
    for chunk in chunks:
        measured = layer_transient(mc, chunk)
        est = linear_attention_activation_bytes(mc, chunk, 2)
        print(f"linear-attention layer transient at chunk {chunk}: measured {measured / MiB:.1f} MiB, "
              f"plan {est / MiB:.1f} MiB ({(est - measured) / measured * 100:+.1f} %)")
    engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", load_format="dummy",
                                 device_limit=parse_size(args.device_limit), max_prefill_tokens=max(chunks),
                                 max_running_requests=4, max_model_len=args.prompt + 64))
    print(engine.plan.table())
    print(f"chunk cap {engine.knobs.max_prefill_tokens}, KV pages {engine.pool.num_pages}, "
          f"state pool {engine.states.nbytes / MiB:.1f} MiB")
    ids = torch.randint(3, mc.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine.add_request(GenerateRequest(request_id="long", prompt_token_ids=ids, sampling=sp))
    got, reason = [], None
    while engine.has_work():
        for o in engine.step():
            got += o.token_ids
            reason = o.finish_reason if o.finished else reason
    took = time.perf_counter() - start
    print(f"{args.prompt}-token prompt: finish {reason}, {len(got)} tokens, {took:.1f} s; "
          f"allocator peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"reserved peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
