"""A tiny random-weight gpt-oss (window of 8 tokens, attention sinks, clamped-SwiGLU
experts; SmolLM2's tokenizer) through a real ``headroom serve`` on the CPU: the greedy
tokens of a prompt sent as ids and of one sent as text equal transformers' (eager
attention)."""

from __future__ import annotations

import pytest
import torch
from model_checks import hf_greedy
from service_harness import served_greedy_tokens, tiny_model_server

pytestmark = pytest.mark.slow

STEPS = 14


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, default_model_dir):
    """(transformers' model, the tokenizer, a server of the same folder)."""
    with tiny_model_server(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, "gpt_oss") as (hf, server):
        yield hf, smollm_tokenizer, server


def test_served_greedy_ids_and_text_equal_transformers(gpt_oss):
    """A 30-token prompt of ids, then a text one, each longer than the window."""
    hf, tokenizer, server = gpt_oss
    ids = torch.randint(3, len(tokenizer), (30,), generator=torch.Generator().manual_seed(8)).tolist()
    assert served_greedy_tokens(server, ids, STEPS) == [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
    text = "Attention sinks let a head look at nothing; the sliding layers see the last eight tokens only."
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 8
    assert served_greedy_tokens(server, text, STEPS) == [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
