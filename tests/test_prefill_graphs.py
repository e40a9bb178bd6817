"""What a prefill graph replays (engine/core/prefill_graphs.py), run eagerly on the CPU
with the Triton attention kernels in Triton's interpreter: the padded static batch the
graph is captured on, filled for a chunk of ``k`` tokens, gives the logits and KV rows
of the same chunk run unpadded, for a fresh prompt and for a chunk after a cached
prefix. (The capture and replay themselves need CUDA: tests/gpu/test_prefill_graphs_gpu.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.core.prefill_graphs import PrefillGraphs, write_inputs
from engine.core.step_inputs import StepInputs
from engine.kvcache.pool import KVPool
from engine.layers.attention.registry import model_attention
from engine.loader.hf_config import load_model_config
from engine.loader.load import load_model

PAGE = 16


def _kv_rows(pool: KVPool, pages: list[int], positions: range) -> list[torch.Tensor]:
    slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in positions])
    return [b[slots].clone() for b in (*pool.k_buffers, *pool.v_buffers)]


@pytest.mark.slow
def test_the_padded_graph_batch_equals_the_eager_chunk(tiny_dir, dev):
    config = load_model_config(tiny_dir)
    model, _ = load_model(tiny_dir, dev, torch.float32)
    pool = KVPool(num_layers=config.num_kv_layers, num_pages=8, page_size=PAGE, num_kv_heads=config.num_kv_heads,
                  head_dim=config.head_dim, dtype=torch.float32, device=dev)
    attn = model_attention("triton", pool, config)
    graphs = PrefillGraphs(model, attn, torch.device(dev), page_size=PAGE, max_tokens=32,
                           max_context_tokens=4 * PAGE)
    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    req = SimpleNamespace(pages=[5, 2, 7], all_ids=ids, prompt_ids=ids, output_ids=[], total_len=40)
    # A fresh chunk of 7 tokens (the 16-token graph), then 9 tokens after the first 16
    # (cached by an eager prefill first), which the 16-token graph also takes.
    for start, k in ((0, 7), (16, 9)):
        if start:
            with torch.inference_mode():
                model(StepInputs(torch.device(dev), PAGE).build(
                    [SimpleNamespace(req=req, start=0, num_tokens=start, samples=False, scores=False)], False), attn)
        item = SimpleNamespace(req=req, start=start, num_tokens=k, samples=True, scores=False)
        size = graphs.size_for([item])
        assert size == 16
        write_inputs(graphs._dev.numpy(), item, size, graphs.max_tokens, PAGE)
        with torch.inference_mode():
            padded = model(graphs._batches[size], attn).clone()
            padded_kv = _kv_rows(pool, req.pages, range(start, start + k))
            eager = model(StepInputs(torch.device(dev), PAGE).build([item], False), attn)
        eager_kv = _kv_rows(pool, req.pages, range(start, start + k))
        assert padded.shape == eager.shape == (1, config.vocab_size)
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        for have, want in zip(padded_kv, eager_kv, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
