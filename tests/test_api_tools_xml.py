"""Qwen3.5 / Qwen3.6's tool calls (Qwen3-Coder's XML: ``<tool_call><function=NAME>
<parameter=P>value</parameter></function></tool_call>``) and thinking, as the chat
template teaches them: the format chosen from the template, the calls parsed into
``tool_calls`` with their values typed by the tool's schema, reasoning apart, streamed
as whole."""

from __future__ import annotations

import json

import pytest
from test_api_tools import WEATHER, _names_args, _replay, chat_template

from engine.text.chat import render_chat, template_has_tools
from service.api.chat_output import ChatOutput
from service.api.tools import (
    QWEN_XML,
    ToolPlan,
    call_start,
    parse_tool_calls,
    parser_for_template,
    plan_tools,
)

FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}

# A template in Qwen3.5's shape: tools listed as JSON, the XML call format taught, the
# generation prompt opening a thinking block unless enable_thinking is false.
QWEN35_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>\\nCall one as <tool_call>\\n<function=NAME>\\n<parameter=NAME>\\nvalue\\n"
    "</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{%- for k, v in c.function.arguments | items %}{{- '<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)

# An answer as Qwen3.5 writes it after the prompt opened <think>: reasoning, words, two calls.
THOUGHT_AND_CALLS = (
    "Paris first, then Rome, three days each.\n</think>\n\nLet me look.\n\n"
    "<tool_call>\n<function=forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[9, 18]\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=forecast>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=note>\nbring\nan umbrella\n</parameter>\n</function>\n</tool_call>"
)
PARIS = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 18]}
ROME = {"city": "Rome", "days": 3, "note": "bring\nan umbrella"}


def test_the_template_chooses_the_xml_format():
    assert parser_for_template(QWEN35_LIKE) == QWEN_XML
    # Llama 3.1's custom-tool example writes <function=...> with JSON, no parameters.
    assert parser_for_template("<|start_header_id|> {{ tools }} <function=f>{...}</function> parameters") != QWEN_XML
    assert plan_tools([FORECAST], None, QWEN35_LIKE, True).parse == QWEN_XML


def test_xml_calls_parse_with_values_typed_by_the_schema():
    content, calls = parse_tool_calls(QWEN_XML, THOUGHT_AND_CALLS.split("</think>")[1], [FORECAST])
    assert content.strip() == "Let me look." and _names_args(calls) == [("forecast", PARIS), ("forecast", ROME)]
    # Without the schema every value is text; a bare <function=...> (no wrapper) parses too.
    bare = "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>"
    assert _names_args(parse_tool_calls(QWEN_XML, bare)[1]) == [("get_weather", {"city": "42"})]
    assert _names_args(parse_tool_calls(QWEN_XML, "<tool_call>\n<function=ping>\n</function>\n</tool_call>")[1]) == [
        ("ping", {})]
    # A number that does not parse stays text; a call cut before </function>, or with
    # stray text among its parameters, is no call: the answer stays content.
    odd = "<tool_call>\n<function=forecast>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    assert _names_args(parse_tool_calls(QWEN_XML, odd, [FORECAST])[1]) == [("forecast", {"days": "three"})]
    for broken in ("<tool_call>\n<function=forecast>\n<parameter=city>\nPar",
                   "<tool_call>\n<function=f>\nhello\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"):
        assert parse_tool_calls(QWEN_XML, broken, [FORECAST]) == (broken, [])
    assert parse_tool_calls(QWEN_XML, "Paris is 3 < 4.") == ("Paris is 3 < 4.", [])
    # A cut opening is held back in a stream; words before it are safe.
    assert call_start(QWEN_XML, "Sure <func") == 5 and call_start(QWEN_XML, "Sure <tool_c") == 5
    assert call_start(QWEN_XML, "Sure.") is None


@pytest.mark.parametrize("size", [1, 5, 23])
def test_reasoning_and_calls_whole_and_streamed(size):
    plan = ToolPlan(tools=[FORECAST], parse=QWEN_XML)
    whole, reason = ChatOutput(n=1, thinking=True, tools=plan).message(THOUGHT_AND_CALLS, "stop")
    assert reason == "tool_calls" and whole.reasoning_content == "Paris first, then Rome, three days each."
    assert whole.content == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in whole.tool_calls] == [PARIS, ROME]
    streamed = _replay(ChatOutput(n=1, thinking=True, tools=plan), THOUGHT_AND_CALLS, size)
    assert streamed["finish"] == ["tool_calls"]
    assert streamed["reasoning_content"].strip() == whole.reasoning_content
    assert streamed["content"].strip() == "Let me look."
    assert [json.loads(c["arguments"]) for c in streamed["tool_calls"].values()] == [PARIS, ROME]


def test_the_template_renders_tools_calls_and_the_thinking_switch(smollm_tokenizer):
    with chat_template(smollm_tokenizer, QWEN35_LIKE) as tokenizer:
        assert template_has_tools(tokenizer)
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]}]
        prompt = render_chat(tokenizer, messages, tools=[WEATHER])
        assert '"name": "get_weather"' in prompt
        # The history's call in the model's own format, which the parser reads back.
        start = prompt.index("<tool_call>\n<function=get_weather>")
        written = prompt[start:prompt.index("<|im_end|>", start)]
        assert _names_args(parse_tool_calls(QWEN_XML, written, [WEATHER])[1]) == [("get_weather", {"city": "Paris"})]
        assert prompt.endswith("<think>\n")
        off = render_chat(tokenizer, messages[:1], template_kwargs={"enable_thinking": False})
        assert off.endswith("<think>\n\n</think>\n\n")


# As Pydantic writes a tool's parameters: a nested model behind a $ref, Optional[...]
# as anyOf with null, an enum behind a $ref, a string union that stays text.
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}},
              "Seat": {"enum": [1, 2]}, "Name": {"type": "string"}},
    "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Place"}, "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                   "seat": {"$ref": "#/$defs/Seat"}, "who": {"$ref": "#/$defs/Name"},
                   "s": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                   "all": {"allOf": [{"$ref": "#/$defs/Place"}]}, "odd": {"$ref": "#/$defs/Nowhere"},
                   "loop": {"$ref": "#/properties/loop"}}}}}


def test_xml_values_behind_refs_and_unions_are_typed_too():
    """A Pydantic tool's ``to: Place`` and ``n: int | None`` came back as the strings
    ``'{"city": "Oslo"}'`` and ``'5'`` (a schema without ``type`` was taken as text),
    which the client's model then refused. Now ``$ref``, ``anyOf``/``oneOf``/``allOf``
    and ``enum`` give the type; a union with string, or a schema no type comes from, text."""
    values = {"to": '{"city": "Oslo"}', "n": "5", "seat": "2", "who": "42", "s": "7", "all": '{"city": "Rome"}',
              "odd": "[1]", "loop": "3"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    _, calls = parse_tool_calls(QWEN_XML, f"<tool_call>\n<function=book>\n{body}</function>\n</tool_call>", [BOOK])
    assert _names_args(calls) == [("book", {"to": {"city": "Oslo"}, "n": 5, "seat": 2, "who": "42", "s": "7",
                                            "all": {"city": "Rome"}, "odd": "[1]", "loop": "3"})]
