"""The warm-up of a fresh prompt's shapes at start (engine.core.profile.warm_up_fresh_prompts,
run on CUDA after the warm-up step, so that a first start's Triton compiles of a fresh
prompt's kernels happen before the service is ready): it runs a fresh sequence alone and
beside a decode row, and leaves nothing behind (greedy answers after it equal an engine's
without it), for a dense and a hybrid model."""

from __future__ import annotations

import pytest
from model_checks import engine_greedy

from engine.common.config import EngineConfig
from engine.core.profile import WARM_UP_PROMPT_TOKENS, warm_up_fresh_prompts

PROMPTS = {"a": [(5 * i + 3) % 250 + 3 for i in range(9)], "b": [(7 * i + 1) % 250 + 3 for i in range(23)]}


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_the_warm_up_runs_fresh_prompts_and_leaves_nothing_behind(tmp_path, make_tiny_hf_model, kind):
    make_tiny_hf_model(kind, tmp_path, vocab_size=256)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32")
    seen = []

    def warm_up(engine, step):
        if step != 1:
            return
        model = engine.model
        states = getattr(model, "states", None)
        forward = model.forward

        def spy(batch, attn):
            seen.append((batch.prefix_lens.tolist(), batch.extend_lens.tolist()))
            return forward(batch, attn)

        model.forward = spy
        try:
            assert warm_up_fresh_prompts(model, engine.attn, engine.pool) == 2
        finally:
            del model.forward
        assert getattr(model, "states", None) is states  # the engine's state pool is bound again

    _, warmed = engine_greedy(config, PROMPTS, 8, on_step=warm_up)
    _, cold = engine_greedy(config, PROMPTS, 8)
    n = WARM_UP_PROMPT_TOKENS
    assert seen == [([0], [n]), ([n - 1, 0], [1, n])]  # a fresh prompt alone, then beside a decode row
    assert warmed == cold
