"""Mixtures of experts on CUDA: the engine with the fused Triton MoE kernel against
transformers on the same card, tiny random-weight configs of each family.

float32: greedy ids must agree for 16 steps (a late divergence on a near-tie of random
weights is allowed after 8 steps, as in test_models_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.messages import GenerateRequest, SamplingParams

KINDS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
STEPS = 16


def _greedy(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    sp = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_token_ids=ids, sampling=sp))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_moe_engine_on_cuda_uses_the_fused_kernel_and_matches_transformers(kind, tmp_path, make_tiny_hf_model,
                                                                           monkeypatch):
    hf = make_tiny_hf_model(kind, tmp_path, vocab_size=512).cuda()
    import kernels.triton_moe as triton_moe

    calls = {"triton": 0}
    triton_impl = triton_moe.fused_moe

    def counting(*args, **kwargs):
        calls["triton"] += 1
        return triton_impl(*args, **kwargs)

    # The dispatcher looks the Triton function up on each call, so counting it here shows
    # the engine took the fused kernel, not the per-expert reference.
    monkeypatch.setattr(triton_moe, "fused_moe", counting)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", kv_cache=256 << 20))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 21, 70)]
    out = _greedy(engine, prompts)
    assert calls["triton"] > 0, "the fused Triton MoE kernel was not used on CUDA"
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=STEPS, min_new_tokens=STEPS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        ref = gen[0, len(ids):].tolist()
        agree = next((j for j, (a, b) in enumerate(zip(out[str(i)], ref, strict=True)) if a != b), STEPS)
        assert agree >= 8, (kind, i, out[str(i)], ref)
