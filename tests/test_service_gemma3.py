"""A tiny random-weight Gemma 3, then Gemma 4 (window of 8 tokens; Gemma 4's global
heads of their own size, shared KV and per-layer embeddings; SmolLM2's tokenizer)
through a real ``headroom serve`` on the CPU: the greedy tokens of a 24-token prompt
equal transformers' (eager attention), for a prompt sent as ids and one sent as text."""

from __future__ import annotations

import pytest
import torch
from model_checks import hf_greedy
from service_harness import served_greedy_tokens, tiny_model_server

pytestmark = pytest.mark.slow

STEPS = 14


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def gemma(request, tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, default_model_dir):
    """(transformers' model, the tokenizer, a server of the same folder), per family."""
    with tiny_model_server(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, request.param,
                           max_position_embeddings=512) as (hf, server):
        yield hf, smollm_tokenizer, server


def test_served_greedy_tokens_equal_transformers(gemma):
    hf, tokenizer, server = gemma
    ids = torch.randint(3, len(tokenizer), (24,), generator=torch.Generator().manual_seed(7)).tolist()
    want = [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
    assert served_greedy_tokens(server, ids, STEPS) == want


def test_served_text_prompt_equals_transformers(gemma):
    hf, tokenizer, server = gemma
    text = "A sliding window sees only the last few tokens of the prompt, the global layers all of them."
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 8  # longer than the window
    want = [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
    assert served_greedy_tokens(server, text, STEPS) == want
