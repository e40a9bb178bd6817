"""Hybrid linear-attention models on CUDA: the engine's Gated DeltaNet layers in
flash-linear-attention's kernels (``chunk_gated_delta_rule`` for prefill,
``fused_recurrent_gated_delta_rule`` for decode) against transformers' torch path on the
same card, tiny random-weight Qwen3-Next configs (dense and MoE).

float32: greedy ids must agree for 32 steps; the kernels' chunked sums differ from the
token-by-token reference in the last bits, so a late divergence on a near-tie of random
weights is allowed after 16 steps.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.messages import GenerateRequest, SamplingParams

pytest.importorskip("fla")
STEPS = 32


@pytest.mark.parametrize("kind", ["qwen3_next_dense", "qwen3_next"])
def test_hybrid_engine_on_cuda_uses_fla_and_matches_transformers(kind, tmp_path, make_tiny_hf_model, monkeypatch):
    hf = make_tiny_hf_model(kind, tmp_path, vocab_size=512).cuda()
    import engine.models.gated_deltanet as gdn

    calls = {"fla": 0}
    real = gdn.GatedDeltaNet._fla

    def counting(self, *args, **kwargs):
        calls["fla"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gdn.GatedDeltaNet, "_fla", counting)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", kv_cache=256 << 20))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 21, 70)]
    sp = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_token_ids=ids, sampling=sp))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert calls["fla"] > 0, "the fla kernels were not used on CUDA"
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=STEPS, min_new_tokens=STEPS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        ref = gen[0, len(ids):].tolist()
        agree = next((j for j, (a, b) in enumerate(zip(out[str(i)], ref, strict=True)) if a != b), STEPS)
        print(f"{kind} prompt {len(ids)}: {agree}/{STEPS} greedy ids equal")
        assert agree >= 16, (kind, i, out[str(i)], ref)
