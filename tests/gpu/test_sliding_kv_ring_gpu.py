"""Sliding-window layers that keep only their window (``--sliding-kv-ring``) on CUDA: a
tiny Gemma 3 (window 8) decodes through CUDA graphs whose static inputs carry the ring's
slots and page table, and its greedy ids equal transformers' on the same device. It
prefills eagerly: windowed models take no prefill graphs (engine.core.prefill_graphs
says why)."""

from __future__ import annotations

import torch
from model_checks import VOCAB, greedy_params, hf_greedy, seeded_prompts

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest


def test_ring_decode_replays_graphs_and_equals_transformers(tmp_path, make_tiny_hf_model):
    hf = make_tiny_hf_model("gemma3", tmp_path, vocab_size=VOCAB).cuda()
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", page_size=4, num_pages=256,
                                 sliding_kv_ring="on", max_prefill_tokens=16, max_running_requests=4,
                                 attention_backend="triton"))
    assert engine.runner.graphs is not None and engine.runner.graphs.ring
    assert engine.runner.prefill_graphs is None
    prompts, sampling = seeded_prompts(VOCAB, 45, 5, 29), greedy_params(16)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_token_ids=ids, sampling=sampling))
    out = {str(i): [] for i in range(3)}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert engine.runner.graphs.replays > 0
    with torch.no_grad():
        assert [out[str(i)] for i in range(3)] == [hf_greedy(hf, ids, 16) for ids in prompts]
