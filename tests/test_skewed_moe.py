"""The skewed-routing MoE checkpoint writer (engine/bench/skewed_moe.py): a small
version loads in the engine, answers, and its router prefers some experts."""

from __future__ import annotations

from pathlib import Path

from engine.bench.skewed_moe import write_skewed_moe

SMALL = dict(hidden_size=64, moe_intermediate_size=32, num_experts=32, num_experts_per_tok=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def test_router_skew_follows_the_zipf_exponent(tmp_path, default_model_dir):
    even = write_skewed_moe(tmp_path / "even", "qwen3-30b-a3b", 1, Path(default_model_dir), 0.0, **SMALL)
    skewed = write_skewed_moe(tmp_path / "skewed", "qwen3-30b-a3b", 1, Path(default_model_dir), 1.2, **SMALL)
    # Experts that take 90 % of the routings (of 32, top-4): nearly all without skew.
    assert even >= 24
    assert skewed <= even - 6


def test_written_checkpoint_loads_and_answers(tmp_path, default_model_dir):
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.wire.messages import GenerateRequest, SamplingParams

    write_skewed_moe(tmp_path, "qwen3-30b-a3b", 2, Path(default_model_dir), 1.0, **SMALL)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache=16 << 20, min_context=256))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest(request_id="a", prompt_token_ids=[1, 2, 3, 4], sampling=sp))
    got = []
    while engine.has_work():
        for o in engine.step():
            got += o.token_ids
    assert len(got) == 4
