"""An Ollama call's prompt is tokenized once: the ids :mod:`service.api.prompt_fit`
made to see whether it fits ``num_ctx`` are the ones the engine gets (it was rendered
and tokenized again by ``encode_prompts``). Counted on the default model's real
tokenizer, wrapped to count its ``encode`` calls, through the routes' request builders
and :func:`service.api.generation.prompt_ids` (the step of ``Generation.start`` that
turns a call's prompts into ids): a chat, a chat with tools, a templated and a raw
``/api/generate`` that fit take one; a chat cut to fit takes only the fit's own, and
its ids are what its cut messages render to."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from service_harness import engine_info

from engine.text.chat import encode_chat, encode_prompt
from engine.text.tokenizer import load_tokenizer
from service.api.generation import prompt_ids
from service.api.ollama.requests import chat_request, generate_request
from service.api.ollama.schemas import OllamaChatRequest, OllamaGenerateRequest
from service.api.prompt_fit import fit_prompts
from service.api.text import TextSide

# A ChatML template that renders tool definitions and teaches Hermes' <tool_call>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


class CountingTokenizer:
    """A real tokenizer whose ``encode`` calls are recorded (their texts); every other
    attribute is the tokenizer's own."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.encoded: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(text)
        return self._tokenizer.encode(text, **kwargs)


@pytest.fixture(scope="module")
def tokenizers(default_model_dir) -> tuple[Any, Any]:
    """The default model's tokenizer, and a second load of it whose template renders tools."""
    with_tools = load_tokenizer(default_model_dir)
    with_tools.chat_template = TOOLS_TEMPLATE
    return load_tokenizer(default_model_dir), with_tools


def _request(route: str, body: dict) -> Any:
    if route == "chat":
        return chat_request(msgspec.convert(body, OllamaChatRequest), "r", time.monotonic(), 0)
    return generate_request(msgspec.convert(body, OllamaGenerateRequest), "r", time.monotonic(), 0)


def _ids(tokenizer: Any, request: Any, context: int) -> tuple[list[int], list[str]]:
    """The call's prompt ids and the texts the tokenizer encoded for them."""
    counting = CountingTokenizer(tokenizer)
    text = TextSide(counting, "default")
    try:
        _, (ids,) = asyncio.run(prompt_ids(text, engine_info(max_context_tokens=context), request, context))
    finally:
        text.close()
    return ids, counting.encoded


MESSAGES = [{"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is a GPU?"}]


@pytest.mark.parametrize(("route", "body", "tools"), [
    ("chat", {"model": "default", "messages": MESSAGES}, False),
    ("chat", {"model": "default", "messages": MESSAGES, "tools": [TOOL]}, True),
    ("generate", {"model": "default", "system": "Answer in one sentence.", "prompt": "What is a GPU?"}, False),
    ("generate", {"model": "default", "prompt": "The history of computing", "raw": True}, False),
], ids=["chat", "chat-tools", "generate", "generate-raw"])
def test_a_prompt_that_fits_is_tokenized_once(tokenizers, route, body, tools):
    tokenizer = tokenizers[1] if tools else tokenizers[0]
    request = _request(route, {**body, "options": {"num_ctx": 512}})
    ids, encoded = _ids(tokenizer, request, 512)
    assert len(encoded) == 1, encoded
    (prompt,) = request.prompts
    if prompt.messages is not None:
        assert ids == encode_chat(tokenizer, prompt.messages, tools=prompt.tools, template_kwargs=prompt.template_kwargs)
        assert ("weather" in encoded[0]) == tools, encoded
    else:
        assert ids == encode_prompt(tokenizer, prompt.text)


def test_a_chat_cut_to_fit_takes_only_the_fits_tokenizing(tokenizers):
    tokenizer = tokenizers[0]
    long = [{"role": "user", "content": "An old question " * 60}, {"role": "assistant", "content": "An answer."},
            {"role": "user", "content": "Tell me about the history of computing " * 20}]
    request = _request("chat", {"model": "default", "messages": long, "options": {"num_ctx": 96, "num_predict": 16}})
    counting = CountingTokenizer(tokenizer)
    text = TextSide(counting, "default")
    try:
        (fitted,) = asyncio.run(fit_prompts(text, request, 96))
    finally:
        text.close()
    # The oldest turns dropped, then the start of the last one cut.
    (last,) = fitted.messages
    assert long[-1]["content"].endswith(last["content"]) and len(last["content"]) < len(long[-1]["content"]), last
    ids, encoded = _ids(tokenizer, request, 96)
    assert encoded == counting.encoded, "the prompt was tokenized again after it was fitted"
    assert ids == encode_chat(tokenizer, fitted.messages) and len(ids) <= 96 - 16


def test_a_long_chat_drops_its_oldest_turns_in_few_renders(tokenizers):
    """The turns to drop are found by halving: a chat of 600 turns rendered once per turn
    dropped (600 renders of up to 600 messages, a long chat's square)."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(600)]
    request = _request("chat", {"model": "default", "messages": turns, "options": {"num_ctx": 96,
                                                                                  "num_predict": 16}})
    counting = CountingTokenizer(tokenizers[0])
    text = TextSide(counting, "default")
    try:
        (fitted,) = asyncio.run(fit_prompts(text, request, 96))
    finally:
        text.close()
    assert len(counting.encoded) <= 12, len(counting.encoded)
    ids = encode_chat(tokenizers[0], fitted.messages)
    assert fitted.messages == turns[-len(fitted.messages):] and len(ids) <= 96 - 16
    # One turn more would not have fitted: the fewest turns were dropped.
    assert len(encode_chat(tokenizers[0], turns[-len(fitted.messages) - 1:])) > 96 - 16


@pytest.mark.parametrize("route", ["chat", "generate-raw"])
def test_a_message_far_past_the_context_is_cut_before_it_is_tokenized(tokenizers, route):
    """A 30 MB message cut to a small num_ctx was tokenized whole three times (40-50 s
    of the service's CPU, on after its client left); only its end that can be kept, with
    as much again to spare, reaches the tokenizer now, and the cut is the same as that
    of a text holding just that end."""
    tokenizer = tokenizers[0]
    words = "".join(f"word{i} " for i in range(200_000))  # 1.4 MB
    if route == "chat":
        body = {"model": "default", "messages": [{"role": "user", "content": words}]}
    else:
        body = {"model": "default", "prompt": words, "raw": True}
    request = _request("chat" if route == "chat" else "generate", {**body, "options": {"num_ctx": 256, "num_predict": 16}})
    counting = CountingTokenizer(tokenizer)
    text = TextSide(counting, "default")
    try:
        limit = 2 * (256 - 16) * text.bytes_per_token
        (fitted,) = asyncio.run(fit_prompts(text, request, 256))
        end = words[-limit:]
        short = _request("chat" if route == "chat" else "generate",
                         {**body, **({"messages": [{"role": "user", "content": end}]} if route == "chat" else
                                     {"prompt": end}), "options": {"num_ctx": 256, "num_predict": 16}})
        (same,) = asyncio.run(fit_prompts(text, short, 256))
    finally:
        text.close()
    assert limit < len(words) // 4 and max(len(t) for t in counting.encoded) <= limit + 200, limit
    if route == "chat":
        assert fitted.messages == same.messages and fitted.ids == same.ids
        assert words.endswith(fitted.messages[0]["content"]) and len(fitted.ids) <= 256 - 16
    else:
        assert fitted.token_ids == same.token_ids and len(fitted.token_ids) <= 256 - 16
