"""A tiny random-weight Gemma 3 (window of 8 tokens, SmolLM2's tokenizer) through a real
``headroom serve`` on the CPU: the greedy tokens of a 24-token prompt equal
transformers' (eager attention), for a prompt sent as ids and one sent as text."""

from __future__ import annotations

import httpx
import pytest
import torch
from model_checks import hf_greedy
from service_harness import ServerProcess

pytestmark = pytest.mark.slow

STEPS = 14


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, default_model_dir):
    """(transformers' model, the tokenizer, a server of the same folder)."""
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    hf = make_tiny_hf_model("gemma3", folder, vocab_size=len(smollm_tokenizer), max_position_embeddings=512)
    smollm_tokenizer.save_pretrained(folder)
    server = ServerProcess(tmp_path_factory.mktemp("gemma3-serve"), ["--model", str(folder), "--device", "cpu"])
    try:
        server.wait_ready()
        yield hf, smollm_tokenizer, server
    finally:
        server.stop()


def served_tokens(server: ServerProcess, prompt) -> list[str]:
    """The greedy completion's tokens, each as the tokenizer decodes it alone."""
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": STEPS, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_served_greedy_tokens_equal_transformers(gemma3):
    hf, tokenizer, server = gemma3
    ids = torch.randint(3, len(tokenizer), (24,), generator=torch.Generator().manual_seed(7)).tolist()
    want = [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
    assert served_tokens(server, ids) == want


def test_served_text_prompt_equals_transformers(gemma3):
    hf, tokenizer, server = gemma3
    text = "A sliding window sees only the last few tokens of the prompt, the global layers all of them."
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 8  # longer than the window
    want = [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
    assert served_tokens(server, text) == want
