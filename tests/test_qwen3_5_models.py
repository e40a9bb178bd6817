"""Qwen3.5 / Qwen3.6 against transformers on tiny random configs: the dense and the MoE
text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) and the vision-language
checkpoints Qwen publishes, of which the language model runs (the vision tower left out,
as the log says). Greedy ids through the engine, with a prompt longer than one 64-token
chunk of the chunked delta rule, and the same
greedy ids from ``headroom serve``, which also splits the template's thinking from the
answer and returns its tool calls; the MoE's routed experts in host memory. Logits, ragged batches, chunked prefill and the state
slots: tests/test_hybrid_models.py, which runs Qwen3.5 beside Qwen3-Next."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
from model_checks import hf_greedy
from service_harness import ServerProcess
from test_api_tools import WEATHER, chat_template
from test_api_tools_xml import QWEN35_LIKE
from test_engine import run_all

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.loader.load import load_model
from engine.wire.messages import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 256
STEPS = 16
KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_ids_equal_transformers(kind, tmp_path, make_tiny_hf_model):
    """Three prompts batched through the engine, the longest (80 ids) prefilled in one
    step: past one 64-token chunk of the chunked delta rule (ours on the CPU, and
    transformers')."""
    hf, path = make_tiny_hf_model(kind, tmp_path, vocab_size=VOCAB), tmp_path
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=128, max_prefill_tokens=128))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 80)]
    sp = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    ours = run_all(engine, {f"r{i}": (ids, sp) for i, ids in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        assert ours[f"r{i}"] == hf_greedy(hf, ids, STEPS)


def test_routed_experts_in_host_memory_answer_the_same(tmp_path, make_tiny_hf_model):
    """The hybrid placement: two MoE layers' routed experts kept in host memory behind
    the expert cache (``--cpu-experts 2`` on a simulated 4 GiB card)."""
    hf = make_tiny_hf_model("qwen3_5_moe_vl", tmp_path, vocab_size=VOCAB)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", page_size=4, cpu_experts="2",
                                 device_total=4 << 30, max_prefill_tokens=16))
    assert engine.plan.cpu_expert_layers == 2 and len(engine.expert_stores) == 2
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    assert run_all(engine, {"r": (ids, sp)})["r"] == hf_greedy(hf, ids, STEPS)


def test_a_vision_language_checkpoint_loads_its_language_model_and_says_so(tmp_path, make_tiny_hf_model, caplog):
    make_tiny_hf_model("qwen3_5_moe_vl", tmp_path, vocab_size=VOCAB)
    with caplog.at_level(logging.INFO, logger="headroom.engine"):
        _, config = load_model(tmp_path, "cpu", torch.float32)
    assert config.architecture == "Qwen3_5MoeForConditionalGeneration" and config.is_hybrid and config.is_moe
    assert any("vision tower not loaded" in r.getMessage() and "model.visual." in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer):
    """The MoE vision-language checkpoint (the shape Qwen3.6-35B-A3B is published in)
    with a Qwen3.5-like chat template (thinking, XML tool calls), served on the CPU:
    ``(transformers model, server)``."""
    folder = tmp_path_factory.mktemp("tiny-qwen3.6")
    hf = make_tiny_hf_model("qwen3_5_moe_vl", folder, vocab_size=len(smollm_tokenizer), max_position_embeddings=512)
    with chat_template(smollm_tokenizer, QWEN35_LIKE):
        smollm_tokenizer.save_pretrained(folder)
    server = ServerProcess(tmp_path_factory.mktemp("serve"), ["--model", str(folder), "--device", "cpu"])
    try:
        server.wait_ready()
        yield hf, server
    finally:
        server.stop()


@pytest.mark.slow
def test_headroom_serve_answers_transformers_greedy_ids(served, smollm_tokenizer):
    """A prompt of token ids answers transformers' greedy ids."""
    hf, server = served
    ids = smollm_tokenizer("The capital of France is a city where")["input_ids"]
    want = smollm_tokenizer.decode(hf_greedy(hf, ids, STEPS), skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)
    body = {"prompt": ids, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert want and choice["text"] == want and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == STEPS


@pytest.mark.slow
def test_headroom_serve_thinks_and_calls_tools_in_its_format(served):
    """The template opens a thinking block, so a plain answer is reasoning; a forced call
    comes back as ``tool_calls`` with arguments of the function's schema."""
    _, server = served
    hi = [{"role": "user", "content": "Weather in Paris?"}]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": hi, **greedy}, timeout=300)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    body = {"messages": hi, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40, "temperature": 0}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
