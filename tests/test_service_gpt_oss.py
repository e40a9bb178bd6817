"""A tiny random-weight gpt-oss (window of 8 tokens, attention sinks, clamped-SwiGLU
experts; SmolLM2's tokenizer with harmony's special tokens added and a harmony chat
template, :data:`test_api_harmony.HARMONY_LIKE`, whose generation prompt opens the
analysis message) through a real ``headroom serve`` on the CPU: the greedy tokens of a
prompt sent as ids and of one sent as text equal transformers' (eager attention); the
answer's channels reach every API (reasoning and content, split where the thinking
budget closes the analysis message; a forced tool call; a tool name its call cannot
carry refused), whole and streamed; an
earlier turn's reasoning reaches the prompt."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest
import torch
from model_checks import hf_greedy
from service_harness import served_greedy_tokens, tiny_model_server
from test_api_harmony import HARMONY_LIKE, HARMONY_TOKENS
from test_api_tools import WEATHER

pytestmark = pytest.mark.slow

STEPS = 14
HI = [{"role": "user", "content": "Hi"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, default_model_dir):
    """(transformers' model, the tokenizer, a server of the same folder)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("harmony-tokenizer")
    smollm_tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = "{% set open_analysis = true %}" + HARMONY_LIKE
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    with tiny_model_server(tmp_path_factory, make_tiny_hf_model, tokenizer, "gpt_oss", eos_token_id=ends) as (hf, server):
        yield hf, tokenizer, server


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)


def _post(server, path: str, body: dict) -> httpx.Response:
    response = httpx.post(server.base_url + path, json=body, timeout=300, headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 200, response.text
    return response


def _formatless(*texts: str) -> bool:
    return not any(token in text for text in texts for token in HARMONY_TOKENS)


def test_served_greedy_ids_and_text_equal_transformers(gpt_oss):
    """A 30-token prompt of ids, then a text one, each longer than the window."""
    hf, tokenizer, server = gpt_oss
    ids = torch.randint(3, len(tokenizer), (30,), generator=torch.Generator().manual_seed(8)).tolist()
    assert served_greedy_tokens(server, ids, STEPS) == [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]
    text = "Attention sinks let a head look at nothing; the sliding layers see the last eight tokens only."
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 8
    assert served_greedy_tokens(server, text, STEPS) == [tokenizer.decode([i]) for i in hf_greedy(hf, ids, STEPS)]


def test_reasoning_and_content_on_every_api(gpt_oss):
    """OpenAI: a budget of 3 tokens closes the analysis the prompt opened, the rest is
    the final message. Ollama's think (no budget): all thinking. Anthropic without
    thinking: a budget of 0, all content."""
    server = gpt_oss[2]
    client = _openai(server)
    args = {"model": "default", "messages": HI, "max_tokens": 16, "temperature": 0,
            "extra_body": {"ignore_eos": True, "thinking_budget": 3}}
    message = client.chat.completions.create(**args).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and _formatless(reasoning, message.content)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed["content"] += choice.delta.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}

    ollama = {"model": "default", "messages": HI, "think": True, "options": {"temperature": 0, "num_predict": 6}}
    whole = _post(server, "/api/chat", {**ollama, "stream": False}).json()["message"]
    assert whole["thinking"] and _formatless(whole["thinking"], whole["content"])
    lines = [json.loads(line) for line in _post(server, "/api/chat", {**ollama, "stream": True}).text.splitlines()]
    assert "".join(line["message"].get("thinking", "") for line in lines) == whole["thinking"]
    assert "".join(line["message"]["content"] for line in lines) == whole["content"]

    anthropic = {"model": "default", "messages": HI, "max_tokens": 10, "temperature": 0}
    blocks = _post(server, "/v1/messages", anthropic).json()["content"]
    assert [b["type"] for b in blocks] == ["text"] and blocks[0]["text"] and _formatless(blocks[0]["text"])


def test_forced_tool_call_on_every_api(gpt_oss):
    """The call opens after the analysis the prompt opened is closed; the grammar
    makes its JSON the function's parameters."""
    server = gpt_oss[2]
    client = _openai(server)
    args = {"model": "default", "messages": HI, "max_tokens": 40, "temperature": 0, "tools": [WEATHER], "tool_choice": NAMED}
    schema = jsonschema_rs.validator_for(WEATHER["function"]["parameters"])
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and schema.is_valid(json.loads(call.function.arguments))
    arguments, finishes = "", []
    for chunk in client.chat.completions.create(stream=True, **args):
        for streamed in chunk.choices:
            arguments += "".join(c.function.arguments or "" for c in streamed.delta.tool_calls or [])
            finishes += [streamed.finish_reason] if streamed.finish_reason else []
    assert arguments == call.function.arguments and finishes == ["tool_calls"]

    tool = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER["function"]["parameters"]}
    answer = _post(server, "/v1/messages", {"model": "default", "messages": HI, "max_tokens": 40, "temperature": 0,
                                            "tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}}).json()
    assert answer["stop_reason"] == "tool_use"
    (use,) = [b for b in answer["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["input"] == json.loads(call.function.arguments)

    # A name the call's header cannot carry: a 400 in each API's shape, naming the tool.
    spaced = {"type": "function", "function": {**WEATHER["function"], "name": "get weather"}}
    refused = httpx.post(server.base_url + "/v1/chat/completions", timeout=300, json={
        **args, "tools": [spaced], "tool_choice": {"type": "function", "function": {"name": "get weather"}}})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "tools[0].function.name"
    assert error["type"] == "invalid_request_error" and "'get weather'" in error["message"]
    refused = httpx.post(server.base_url + "/v1/messages", timeout=300, headers={"anthropic-version": "2023-06-01"},
                         json={"model": "default", "messages": HI, "max_tokens": 40,
                               "tools": [{**tool, "name": "get weather"}]})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "'get weather'" in refused.json()["error"]["message"]


def test_an_earlier_turns_reasoning_reaches_the_prompt(gpt_oss):
    """The same conversation with and without the tool-call turn's reasoning: the
    template writes it back, so the prompt is longer by its analysis message."""
    server = gpt_oss[2]
    client = _openai(server)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

    def prompt_tokens(**reasoning: str) -> int:
        history = [*HI, {"role": "assistant", "content": None, "tool_calls": [call], **reasoning},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        answer = client.chat.completions.create(model="default", messages=history, tools=[WEATHER], max_tokens=1)
        return answer.usage.prompt_tokens

    analysis = gpt_oss[1].encode("<|start|>assistant<|channel|>analysis<|message|>Paris needs a call.<|end|>",
                                 add_special_tokens=False)
    assert prompt_tokens(reasoning_content="Paris needs a call.") == prompt_tokens() + len(analysis)


def test_a_schema_answer_is_the_final_message(gpt_oss):
    """response_format: the server opens the final message after the analysis the prompt
    opened, and the grammar makes its body the JSON, which is the content."""
    server = gpt_oss[2]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    message = _openai(server).chat.completions.create(model="default", messages=HI, max_tokens=30, temperature=0,
                                                       response_format=fmt).choices[0].message
    assert isinstance(json.loads(message.content)["n"], int) and not message.model_extra.get("reasoning_content")
