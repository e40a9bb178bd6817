"""A served model that can think and call tools, for the tests of reasoning and tools:
a tiny random-weight Qwen3 whose template (:data:`THINKING_TEMPLATE`) has tools and
thinking (its generation prompt opens a thinking block unless ``enable_thinking`` is
false, so every word it says is reasoning). One server for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from service_harness import ServerProcess, serving

# A Qwen-like chat template: tools, tool calls and turns, and enable_thinking.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)

THINKING_TEMPLATE = QWEN_LIKE.replace(
    "<think>\n\n</think>\n\n{% endif %}", "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
)


@pytest.fixture(scope="session")
def qwen3_server(
    tmp_path_factory, make_tiny_hf_model, smollm_tokenizer, default_model_dir
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_tiny_hf_model(
        "qwen3", folder, vocab_size=len(smollm_tokenizer), max_position_embeddings=512
    )
    original = smollm_tokenizer.chat_template
    smollm_tokenizer.chat_template = THINKING_TEMPLATE
    try:
        smollm_tokenizer.save_pretrained(folder)
    finally:
        smollm_tokenizer.chat_template = original
    yield from serving(
        ServerProcess(tmp_path_factory.mktemp("qwen3-serve"), ["--model", str(folder), "--device", "cpu"])
    )
