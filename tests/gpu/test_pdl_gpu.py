"""Programmatic dependent launch (:mod:`kernels.pdl`) on the GPU: a decode step whose
Triton kernels start before the kernel ahead of them ends gives the same logits, bit for
bit, as the same step launched in stream order, eagerly and replayed from a CUDA graph
many times (a kernel reading its input before the one writing it had ended would show as
a difference in some replay). Two layers of the benchmark's Llama-3-8B-shape Q4_K_M-like
GGUF (norms, the int8 GEMV, rotary and KV store, Triton attention, SiLU-and-mul) and the
same shape in bfloat16 (cuBLAS projections between the Triton kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import pdl

REPLAYS = 20


def _step_logits(model, config, batch_size: int, monkeypatch, on: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An eager decode step's logits and ``REPLAYS`` replays of its CUDA graph, with PDL
    ``on`` or off (the ``pdl`` kernel switch), over a KV pool of fixed random values
    (context 256)."""
    from kernels.switches import using

    with using(pdl=on):
        assert pdl.enabled(torch.device("cuda")) is on
        return _step_logits_now(model, config, batch_size)


def _step_logits_now(model, config, batch_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from engine.bench.kernels import _decode_batch
    from engine.kvcache.pool import KVPool
    from engine.layers.attention.registry import create_attention_backend

    context, page = 256, 16
    dtype = model.model.embed_tokens.weight.dtype
    pool = KVPool(num_layers=config.num_layers, num_pages=batch_size * (context // page + 1) + 2, page_size=page,
                  num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, device="cuda", generator=g))
    attn = create_attention_backend("triton", pool, num_heads=config.num_heads, head_dim=config.head_dim,
                                    scale=config.head_dim**-0.5, max_batch=batch_size)
    batch = _decode_batch(batch_size, context, page, "cuda")
    batch.input_ids.copy_(torch.arange(batch_size, device="cuda") * 7 + 3)
    attn.prepare(batch)
    attn.prepare = lambda _batch: None  # the metadata once, outside the capture
    eager = model(batch, attn).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(batch, attn)  # warm (autotuning) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(batch, attn)
    replays = []
    for _ in range(REPLAYS):
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    return eager, replays


def _assert_same_with_and_without(model, config, monkeypatch) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or later")
    for batch_size in (1, 16):
        eager_off, replays_off = _step_logits(model, config, batch_size, monkeypatch, False)
        eager_on, replays_on = _step_logits(model, config, batch_size, monkeypatch, True)
        assert bool(torch.isfinite(eager_off).all())
        assert torch.equal(eager_on, eager_off), float((eager_on - eager_off).abs().max())
        for i, (on, off) in enumerate(zip(replays_on, replays_off, strict=True)):
            assert torch.equal(on, eager_off), f"batch {batch_size}, replay {i} with PDL differs"
            assert torch.equal(off, eager_off), f"batch {batch_size}, replay {i} without PDL differs"


def test_pdl_decode_of_gguf_blocks_equals_stream_order(tmp_path, monkeypatch):
    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_gguf
    from engine.loader.gguf_quant import load_gguf_quantized
    from engine.loader.hf_config import load_model_config

    config = load_model_config(write_shape("llama-3.1-8b", tmp_path / "cfg", num_hidden_layers=2, vocab_size=16384))
    path = tmp_path / "k.gguf"
    write_random_gguf(path, config, np.random.default_rng(0))
    model = load_gguf_quantized(config, path, "cuda", torch.bfloat16)
    _assert_same_with_and_without(model, config, monkeypatch)


def test_pdl_decode_of_bfloat16_weights_equals_stream_order(tmp_path, monkeypatch):
    from engine.bench.model_shapes import write_shape
    from engine.loader.hf_config import load_model_config
    from engine.loader.load import load_model

    folder = write_shape("llama-3.1-8b", tmp_path / "cfg", num_hidden_layers=2, vocab_size=16384)
    config = load_model_config(folder)
    torch.manual_seed(0)
    model, _ = load_model(folder, "cuda", torch.bfloat16, load_format="dummy")
    _assert_same_with_and_without(model, config, monkeypatch)
