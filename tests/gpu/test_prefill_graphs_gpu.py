"""One sequence's prefill replayed from CUDA graphs (engine/core/prefill_graphs.py)
against the same prefill run eagerly: the same greedy ids through the engine (fresh
prompts, a prompt sharing a cached prefix, a prompt chunked into several extends, a
live pool resize in between), and the same logits and KV rows on a GGUF model kept in
its blocks (the packed GEMM at padded row counts, inside the capture)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_fast_path_gpu import _random_prompts, _shape_engine, run_greedy

from engine.core.prefill_graphs import PrefillGraphs


def _one_by_one(engine, prompts, new_tokens=12):
    """Each prompt alone (a one-sequence prefill), then the third one with more tokens:
    its first 128 are in the prefix cache, so the last prefill extends a cached prefix."""
    out = [run_greedy(engine, [p], new_tokens=new_tokens)[0] for p in prompts]
    out.append(run_greedy(engine, [prompts[2] + prompts[1][:21]], new_tokens=new_tokens)[0])
    return out


@pytest.mark.parametrize("chunk", [2048, 64])
def test_prefill_graphs_give_the_eager_greedy_ids(tmp_path, chunk):
    """float32, so the comparison is about the replay's inputs and padding (a padded
    chunk runs the projections on more rows, which float32 adds in the same order per
    row)."""
    prompts = _random_prompts(4, lengths=(7, 40, 130, 300))
    runs = {}
    for tokens in (512, 0):
        engine = _shape_engine(tmp_path / str(tokens), kv_cache=1 << 30, max_running_requests=4,
                               max_prefill_tokens=chunk, prefill_graph_tokens=tokens)
        graphs = engine.runner.prefill_graphs
        assert (graphs is not None) == bool(tokens)
        runs[tokens] = _one_by_one(engine, prompts)
        if tokens:
            assert graphs.sizes[-1] == min(512, chunk)
            # Every prefill chunk fits a graph: 303 tokens in one chunk of 512, or five of 64 (1 + 1 + 3 + 5, then 25 after the cached 128).
            assert graphs.replays >= (5 if chunk == 2048 else 11), graphs.replays
            # A live resize drops the graphs; the next prefill captures every size again.
            captures = graphs.captures
            engine.runner.pool_will_move()
            assert run_greedy(engine, [prompts[2]], new_tokens=12)[0] == runs[tokens][2]
            assert graphs.captures == captures + len(graphs.sizes)
        del engine
        torch.cuda.empty_cache()
    assert runs[512] == runs[0]


def test_prefill_graph_of_gguf_blocks_equals_eager(tmp_path):
    """Two layers of the benchmark's 8B Q4_K_M-like file in bfloat16: a prefill of 40
    tokens replayed from the 64-token graph against the same 40 run eagerly: the logits
    of the last token and every KV row the prompt wrote agree to a few bfloat16 ulps
    (the padded projections tile their rows differently)."""
    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_gguf
    from engine.core.step_inputs import StepInputs
    from engine.kvcache.pool import KVPool
    from engine.layers.attention.registry import create_attention_backend
    from engine.loader.gguf_quant import load_gguf_quantized
    from engine.loader.hf_config import load_model_config

    config = load_model_config(write_shape("llama-3.1-8b", tmp_path / "cfg", num_hidden_layers=2, vocab_size=16384))
    path = tmp_path / "k.gguf"
    write_random_gguf(path, config, np.random.default_rng(0))
    model = load_gguf_quantized(config, path, "cuda", torch.bfloat16)
    pool = KVPool(num_layers=config.num_layers, num_pages=16, page_size=16, num_kv_heads=config.num_kv_heads,
                  head_dim=config.head_dim, dtype=torch.bfloat16, device="cuda")
    attn = create_attention_backend("triton", pool, num_heads=config.num_heads, head_dim=config.head_dim,
                                    scale=config.head_dim**-0.5, max_batch=4)
    ids = torch.randint(10, 16000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    req = SimpleNamespace(pages=[3, 4, 5], all_ids=ids, prompt_ids=ids, output_ids=[], total_len=40)
    item = SimpleNamespace(req=req, start=0, num_tokens=40, samples=True, scores=False)

    def kv_rows():
        slots = torch.tensor([req.pages[p // 16] * 16 + p % 16 for p in range(40)], device="cuda")
        return [b.view(-1, *b.shape[-2:])[slots].float().clone() for b in (*pool.k_buffers, *pool.v_buffers)]

    with torch.inference_mode():
        eager = model(StepInputs(torch.device("cuda"), 16).build([item], False), attn).float().clone()
        want_kv = kv_rows()
        for b in (*pool.k_buffers, *pool.v_buffers):
            b.zero_()
        graphs = PrefillGraphs(model, attn, torch.device("cuda"), page_size=16, max_tokens=128,
                               max_context_tokens=16 * 16)
        graphs.capture_all()
        got = graphs.run([item]).float().clone()
    assert graphs.sizes == [16, 32, 64, 128] and graphs.replays == 1
    assert bool(torch.isfinite(got).all())
    scale = float(eager.abs().max())
    assert float((got - eager).abs().max()) <= 2**-6 * scale
    for have, want in zip(kv_rows(), want_kv, strict=True):
        assert float((have - want).abs().max()) <= 2**-6 * float(want.abs().max()) + 1e-6


def test_a_model_whose_prefill_cannot_be_captured_prefills_eagerly(tmp_path, monkeypatch, caplog):
    """A model whose extend forward reads back from the device (here a ``.item()``, as
    a model's prefill path could hold): the check before any capture finds it, nothing
    is captured, the engine starts and logs it, and prefills eagerly with the same
    greedy ids; its decode graphs are untouched."""
    import logging

    from engine.models.decoder import CausalLM

    prompts = _random_prompts(3, lengths=(40, 77, 130))
    eager = _shape_engine(tmp_path / "eager", kv_cache=1 << 30, max_running_requests=4, prefill_graph_tokens=0)
    want = _one_by_one(eager, prompts)
    del eager
    forward = CausalLM.forward

    def syncing(self, batch, attn):
        if not batch.is_decode:
            batch.input_ids.sum().item()
        return forward(self, batch, attn)

    monkeypatch.setattr(CausalLM, "forward", syncing)
    caplog.set_level(logging.WARNING, logger="headroom.engine")
    engine = _shape_engine(tmp_path / "graphs", kv_cache=1 << 30, max_running_requests=4)
    assert engine.runner.prefill_graphs is None and engine.runner.graphs is not None
    assert any("prefill reads back from the device" in r.getMessage() for r in caplog.records)
    assert _one_by_one(engine, prompts) == want
