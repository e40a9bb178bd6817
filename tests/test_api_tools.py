"""Reasoning and tool calls on recorded model outputs (no server): the parsers of each
family, the answer shaped whole and streamed in small pieces (the stream, put back
together as the openai client does, equals the whole answer), tool_choice checks, and
tools and chat_template_kwargs reaching a template."""

from __future__ import annotations

import contextlib
import json

import msgspec
import pytest
from thinking_server import QWEN_LIKE

from engine.text.chat import ChatTemplateError, render_chat, template_has_tools
from service.api.chat_output import ChatOutput
from service.api.openai.schemas import ChatCompletionRequest
from service.api.reasoning import ReasoningSplitter, split_reasoning
from service.api.tool_checks import check_call_arguments
from service.api.tools import (
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    QWEN_XML,
    ToolPlan,
    parse_tool_calls,
    parser_for_template,
    plan_tools,
)
from service.common.errors import APIError, decode_body

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

# Answers as the families write them (special tokens left out, as the API shows text).
QWEN3_THINK_AND_CALL = (
    "<think>\nThe user asks about Paris and Rome; I will call get_weather twice.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
HERMES_TEXT_THEN_CALL = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TWO = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
MISTRAL_CALLS = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_SKIPPED_TAG = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


def _names_args(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_parser():
    content, calls = parse_tool_calls(HERMES, QWEN3_THINK_AND_CALL.split("</think>")[1])
    assert content == ""
    assert _names_args(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    content, calls = parse_tool_calls(HERMES, HERMES_TEXT_THEN_CALL)
    assert content == "Let me check." and _names_args(calls) == [("get_weather", {"city": "Oslo"})]
    # Unclosed (the end token came first) still parses; broken JSON stays text.
    content, calls = parse_tool_calls(HERMES, '<tool_call>\n{"name": "f", "arguments": {}}')
    assert _names_args(calls) == [("f", {})]
    broken = '<tool_call>\n{"name": "f", "argu'
    assert parse_tool_calls(HERMES, broken) == (broken, [])
    assert parse_tool_calls(HERMES, "Paris.") == ("Paris.", [])


def test_llama3_and_mistral_parsers():
    assert _names_args(parse_tool_calls(LLAMA3_JSON, LLAMA3_CALL)[1]) == [
        ("get_weather", {"city": "Paris"})
    ]
    assert _names_args(parse_tool_calls(LLAMA3_JSON, LLAMA3_TWO)[1]) == [("a", {}), ("b", {"x": 1})]
    assert parse_tool_calls(LLAMA3_JSON, "{not a call} really")[1] == []
    for text in (MISTRAL_CALLS, MISTRAL_SKIPPED_TAG, MISTRAL_V11):
        content, calls = parse_tool_calls(MISTRAL, text)
        assert content == "" and _names_args(calls) == [("get_weather", {"city": "Paris"})], text
    assert parse_tool_calls(MISTRAL, "[1, 2] is a list") == ("[1, 2] is a list", [])


def test_parser_chosen_from_template():
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert parser_for_template("{{ '[TOOL_CALLS]' }} {{ tools }}") == MISTRAL
    assert parser_for_template("<|start_header_id|> {{ tools }} parameters") == LLAMA3_JSON
    assert parser_for_template("{{ messages }}") is None


def test_reasoning_split_whole_and_streamed():
    reasoning, content = split_reasoning("<think>\nhmm\n</think>\n\nParis.")
    assert (reasoning, content) == ("hmm", "Paris.")
    assert split_reasoning("Paris.") == (None, "Paris.")
    # The prompt opened the block: the answer starts inside it, with no <think>.
    assert split_reasoning("hmm</think>Paris.", in_reasoning=True) == ("hmm", "Paris.")
    # Tags cut anywhere between pieces never leak into content.
    text = "<think>a < b</think>x <think> stays"
    for size in (1, 2, 3, 5):
        splitter = ReasoningSplitter()
        parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(splitter.flush())
        assert "".join(r for r, _ in parts) == "a < b"
        assert "".join(c for _, c in parts) == "x <think> stays"


def _replay(output: ChatOutput, text: str, size: int, finish: str = "stop") -> dict:
    """Stream ``text`` in ``size``-character pieces and put the deltas back together
    as the openai client's stream accumulator does."""
    events = output.deltas(0, "", None, "assistant")
    for i in range(0, len(text), size):
        events += output.deltas(0, text[i : i + size], None, None)
    events += output.deltas(0, "", finish, None)
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finishes = [e.finish_reason for e in events if e.finish_reason]
    for event in events:
        d = event.delta
        message["content"] += d.content or ""
        message["reasoning_content"] += d.reasoning_content or ""
        for call in d.tool_calls or []:
            slot = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                slot["id"] = call["id"]
                slot["name"] += call["function"]["name"]
            slot["arguments"] += call["function"]["arguments"]
    message["finish"] = finishes
    return message


@pytest.mark.parametrize("size", [1, 4, 17])
def test_streamed_answer_equals_whole_answer(size):
    plan = ToolPlan(tools=[WEATHER], parse=HERMES)
    whole, reason = ChatOutput(n=1, thinking=False, tools=plan).message(
        QWEN3_THINK_AND_CALL, "stop"
    )
    assert reason == "tool_calls"
    assert whole.reasoning_content.startswith("The user asks")
    assert whole.content is None and len(whole.tool_calls) == 2
    streamed = _replay(ChatOutput(n=1, thinking=False, tools=plan), QWEN3_THINK_AND_CALL, size)
    assert streamed["finish"] == ["tool_calls"]
    assert streamed["reasoning_content"].strip() == whole.reasoning_content
    assert streamed["content"].strip() == ""
    got = [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"].values()]
    want = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls
    ]
    assert got == want
    # Words before a call stream as content; an answer without a call is all content.
    text_first = _replay(ChatOutput(n=1, tools=plan), HERMES_TEXT_THEN_CALL, size)
    assert text_first["content"].strip() == "Let me check." and len(text_first["tool_calls"]) == 1
    plain = _replay(ChatOutput(n=1, tools=plan), "It is 3 < 4 <tool", size)
    assert plain["content"] == "It is 3 < 4 <tool" and plain["finish"] == ["stop"]


@pytest.mark.parametrize("fmt", [HERMES, QWEN_XML, LLAMA3_JSON, MISTRAL])
def test_forced_calls_parse_what_the_grammar_lets_through(fmt):
    template = {HERMES: "<tool_call>", QWEN_XML: "<tool_call><function=<parameter=", LLAMA3_JSON: "<|python_tag|>",
                MISTRAL: "[TOOL_CALLS]"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    # Named: the prefix holds the name, the grammar is the function's parameters.
    plan = plan_tools([WEATHER], named, "{{ tools }}" + template[fmt], True)
    assert json.loads(plan.schema) == WEATHER["function"]["parameters"]
    message, reason = ChatOutput(n=1, tools=plan).message('{"city": "Paris"}', "stop")
    assert reason == "tool_calls" and message.content is None
    assert json.loads(message.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # Required: the grammar is any tool's whole call.
    plan = plan_tools([WEATHER], "required", "{{ tools }}" + template[fmt], True)
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    assert json.loads(plan.schema)["properties"]["name"] == {"const": "get_weather"}
    written = json.dumps({"name": "get_weather", key: {"city": "Oslo"}})
    streamed = _replay(ChatOutput(n=1, tools=plan), written, 3)
    assert streamed["finish"] == ["tool_calls"]
    assert [json.loads(c["arguments"]) for c in streamed["tool_calls"].values()] == [
        {"city": "Oslo"}
    ]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_cut_by_max_tokens_answers_the_same_streamed_or_not(fmt, choice):
    """Cut before its JSON closes, a forced call is no call: the answer is the model's
    text (no opening or closing the model never wrote), ``finish_reason`` "length"."""
    template = {HERMES: "<tool_call>", LLAMA3_JSON: "<|python_tag|>", MISTRAL: "[TOOL_CALLS]"}
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    plan = plan_tools([WEATHER], tool_choice, "{{ tools }}" + template[fmt], True)
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    cut = '{"city": "Par' if choice == "named" else '{"name": "get_weather", "' + key + '": {"ci'
    message, reason = ChatOutput(n=1, tools=plan).message(cut, "length")
    assert message.content == cut and not message.tool_calls and reason == "length"
    for size in (1, 4, 100):
        streamed = _replay(ChatOutput(n=1, tools=plan), cut, size, "length")
        assert streamed["content"] == cut and not streamed["tool_calls"], streamed
        assert streamed["finish"] == ["length"]


def test_tool_choice_checks():
    template = "{{ tools }}<tool_call>"
    assert plan_tools(None, None, template, True) == ToolPlan()
    assert plan_tools([WEATHER], "none", template, True).parse is None
    assert plan_tools([WEATHER], None, template, True).parse == HERMES
    assert plan_tools([WEATHER], "required", template, True).prefix.startswith("<tool_call>")
    for tools, choice, param in [
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        ([{"type": "function"}], None, "tools[0].function"),
    ]:
        with pytest.raises(APIError) as exc:
            plan_tools(tools, choice, template, True)
        assert exc.value.param == param and exc.value.status == 400
    with pytest.raises(APIError, match="no tool support") as exc:
        plan_tools([WEATHER], None, "{{ messages }}", False)
    assert exc.value.param == "tools"
    # A value no call could take says so, tools or not; a forced call without tools needs them.
    with pytest.raises(APIError, match="tool_choice must be 'none', 'auto', 'required'"):
        plan_tools(None, "sometimes", template, True)
    with pytest.raises(APIError, match="tool_choice needs tools"):
        plan_tools(None, "required", template, True)


@pytest.mark.parametrize("tools", [[WEATHER], None])
@pytest.mark.parametrize(("choice", "code"), [
    (5, "invalid_type"), (True, "invalid_type"), (["auto"], "invalid_type"), ("sometimes", "invalid_value"),
])
def test_a_tool_choice_of_the_wrong_json_type_is_invalid_type(tools, choice, code):
    """docs/api.md, Errors: a field of the wrong JSON type is ``invalid_type``, as
    /v1/responses answers its ``tool_choice``; a string or an object that is no choice
    stays ``invalid_value``. ``tool_choice: 5`` was ``invalid_value``, tools or not."""
    with pytest.raises(APIError) as exc:
        plan_tools(tools, choice, "{{ tools }}<tool_call>", True)
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, "tool_choice", code), exc.value.message
    assert exc.value.message.startswith("tool_choice must be"), exc.value.message


@pytest.mark.parametrize(("tool", "param", "code"), [
    ({"type": "function", "function": {"name": 5}}, "tools[0].function.name", "invalid_type"),
    ({"type": "function", "function": {"name": None}}, "tools[0].function.name", "invalid_type"),
    ({"type": "function", "function": {"description": "no name"}}, "tools[0].function.name", "missing_field"),
    (5, "tools[0]", "invalid_type"),
    ({"type": "function"}, "tools[0].function", "missing_field"),
    ({"type": "function", "function": "f"}, "tools[0].function", "invalid_type"),
    ({"type": "retrieval", "function": {"name": "f"}}, "tools[0]", "invalid_value"),
    ({"type": "function", "function": {"name": "f", "parameters": "x"}}, "tools[0].function.parameters", "invalid_type"),
    ({"type": "function", "function": {"name": " "}}, "tools[0]", "invalid_value"),
])
def test_a_tools_function_name_of_the_wrong_json_type_names_it(tool, param, code):
    """docs/api.md, Errors: a tool's ``function`` or ``function.name`` absent is
    ``missing_field``, of another JSON type (``parameters`` too) ``invalid_type``, naming
    the field (``tools[i].function.name``, as /v1/responses names its ``tools[i].name``);
    they were ``invalid_value`` naming only ``tools[i]``. Each refusal's message starts with the field, the only place Ollama's
    ``{"error": message}`` shape has for it (/api/chat's tools are checked here too)."""
    with pytest.raises(APIError) as exc:
        plan_tools([WEATHER, tool], None, "{{ tools }}<tool_call>", True)
    param = param.replace("tools[0]", "tools[1]")
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, param, code), exc.value.message
    assert exc.value.message.startswith(param), exc.value.message


@contextlib.contextmanager
def chat_template(tokenizer, template: str):
    """``tokenizer`` with ``template`` as its chat template inside the block."""
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        yield tokenizer
    finally:
        tokenizer.chat_template = original


def test_template_gets_tools_tool_messages_and_kwargs(smollm_tokenizer):
    with chat_template(smollm_tokenizer, QWEN_LIKE) as tokenizer:
        assert template_has_tools(tokenizer)
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        prompt = render_chat(tokenizer, messages, tools=[WEATHER])
        assert "Tools: get_weather" in prompt
        # arguments reach the template parsed, so tojson writes them once.
        assert '"arguments": {"city": "Paris"}' in prompt
        assert "<|im_start|>tool\nsunny" in prompt
        off = render_chat(tokenizer, messages[:1], template_kwargs={"enable_thinking": False})
        assert off.endswith("<think>\n\n</think>\n\n")
        assert not render_chat(tokenizer, messages[:1]).endswith("</think>\n\n")
        with pytest.raises(ChatTemplateError) as exc:
            render_chat(tokenizer, messages[:1], template_kwargs={"tools": []})
        assert exc.value.param == "chat_template_kwargs"
    # The default model's template renders no tools: a tool role is refused, naming why.
    with pytest.raises(ChatTemplateError, match="no tool support") as exc:
        render_chat(tokenizer, messages)
    assert exc.value.param == "messages[2].role"


def test_past_call_arguments_nested_past_the_json_reader_s_depth_stay_text(smollm_tokenizer):
    """A client's earlier call whose arguments nest deeper than Python's JSON reader goes
    reaches the template as the text it sent (never an error of the server's)."""
    deep = "[" * 3000
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with chat_template(smollm_tokenizer, QWEN_LIKE) as tokenizer:
        prompt = render_chat(tokenizer, [*messages, {"role": "user", "content": "Bye"}], tools=[WEATHER])
    assert f'"arguments": "{deep}"' in prompt


def test_odd_tool_choice_and_template_kwargs_are_400s(smollm_tokenizer):
    for choice in ({"type": "function", "function": "get_weather"}, {"type": "x"}, ["auto"]):
        with pytest.raises(APIError) as exc:
            plan_tools([WEATHER], choice, "{{ tools }}<tool_call>", True)
        assert exc.value.param == "tool_choice"
    for kwargs in ({"chat_template": "{{ 1 }}"}, {"continue_final_message": True}):
        with pytest.raises(ChatTemplateError) as err:
            render_chat(
                smollm_tokenizer, [{"role": "user", "content": "hi"}], template_kwargs=kwargs
            )
        assert err.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"functions": [{"name": "f"}]}, "functions"), ({"function_call": {"name": "f"}}, "function_call")],
)
def test_deprecated_functions_are_refused_naming_their_field(fields, param):
    from service.api.openai.requests import chat_request

    body = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)
    with pytest.raises(APIError) as info:
        chat_request(body, "r", 0.0, 0)
    assert info.value.param == param and "tools" in info.value.message
    neutral = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "function_call": "auto",
                               "functions": []}, ChatCompletionRequest)
    assert chat_request(neutral, "r", 0.0, 0).max_tokens is None


_CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}


@pytest.mark.parametrize(("answer", "code"), [
    ({"role": "tool", "content": "sunny"}, "missing_field"),
    ({"role": "tool", "tool_call_id": 5, "content": "sunny"}, "invalid_type"),
    ({"role": "tool", "tool_call_id": None, "content": "sunny"}, "invalid_type"),
    ({"role": "tool", "tool_call_id": ["c1"], "content": "sunny"}, "invalid_type"),
])
def test_a_tool_messages_tool_call_id_absent_or_of_the_wrong_type_names_it(answer, code):
    """docs/api.md, Errors: a tool message's ``tool_call_id`` absent is
    ``missing_field``, of another JSON type ``invalid_type``, naming
    ``messages[i].tool_call_id`` (as /v1/responses names an output's
    ``input[i].call_id``); it was ``invalid_value`` naming only ``messages[i]``, as a
    tool message answering no call ("tool_call_id None answers no call...")."""
    from service.api.openai.requests import chat_request

    def body(tool: dict) -> ChatCompletionRequest:
        raw = json.dumps({"messages": [{"role": "user", "content": "hi"}, _CALLED, tool], "tools": [WEATHER]})
        return decode_body(raw.encode(), ChatCompletionRequest)

    with pytest.raises(APIError) as exc:
        chat_request(body(answer), "r", 0.0, 0)
    error = exc.value
    assert (error.status, error.param, error.code) == (400, "messages[2].tool_call_id", code), error.message
    assert error.message.startswith("messages[2].tool_call_id"), error.message
    assert chat_request(body({**answer, "tool_call_id": "c1"}), "r", 0.0, 0).tools == [WEATHER]


def test_json_nested_past_the_parser_s_depth_is_content_not_an_error():
    """A degenerate model can nest brackets deeper than Python's JSON reader goes (a
    RecursionError, not a ValueError): each format answers that text as content."""
    deep = "[" * 3000
    nested_object = '{"a": ' * 1500
    answers = {
        HERMES: "<tool_call>\n" + deep,
        LLAMA3_JSON: nested_object,
        MISTRAL: "[TOOL_CALLS]" + deep,
        QWEN_XML: "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + deep + "\n</parameter>\n</function>\n</tool_call>",
        HARMONY: "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + deep + "<|call|>",
    }
    tools = [{"type": "function", "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "array"}}}}}]
    for fmt, text in answers.items():
        content, calls = parse_tool_calls(fmt, text, tools)
        if fmt == QWEN_XML:  # the value stays the text the model wrote
            assert json.loads(calls[0].arguments) == {"city": deep}
        else:
            assert deep in content or nested_object in content, fmt
            assert calls == [], fmt


NUMS = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}, "o": {"type": "object"}}}}}
# Numbers no JSON carries: Python reads NaN and Infinity, and 1e999 (valid JSON text, past
# a double's range) as infinity, and would write each back as NaN or Infinity.
NOT_FINITE = ["1e999", "-8e6760956908", "NaN", "Infinity", "-Infinity"]


@pytest.mark.parametrize("number", NOT_FINITE)
@pytest.mark.parametrize("fmt", [HERMES, QWEN_XML, LLAMA3_JSON, MISTRAL, HARMONY])
def test_a_call_with_a_number_json_cannot_carry_is_text_or_a_string(fmt, number):
    """A random model's forced call wrote ``"x": -8e6760956908`` and the answer's
    arguments were ``{"x": -Infinity}``: no JSON, refused by the server itself when the
    call came back in the next turn. Now such a call is text (a call that does not
    parse), or, in the XML format where a value that does not parse as its type stays
    text, the number's text; every call's arguments are JSON this server takes back."""
    body = f'{{"x": {number}}}'
    answers = {
        HERMES: f'<tool_call>\n{{"name": "f", "arguments": {body}}}\n</tool_call>',
        QWEN_XML: f"<tool_call>\n<function=f>\n<parameter=x>\n{number}\n</parameter>\n</function>\n</tool_call>",
        LLAMA3_JSON: f'{{"name": "f", "parameters": {body}}}',
        MISTRAL: f"[TOOL_CALLS]f[ARGS]{body}",
        HARMONY: f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{body}<|call|>",
    }
    text = answers[fmt]
    content, calls = parse_tool_calls(fmt, text, [NUMS])
    for call in calls:
        check_call_arguments(call.arguments, "messages[1].tool_calls[0].function.arguments")
        assert json.loads(call.arguments, parse_constant=lambda c: pytest.fail(c)) == {"x": number}
    if not calls:
        assert content == (body if fmt == HARMONY else text)
    assert calls or fmt != QWEN_XML
    # The XML's JSON body (a forced call) and a typed object parameter alike.
    if fmt == QWEN_XML:
        forced = f'<tool_call>\n{{"name": "f", "arguments": {body}}}\n</tool_call>'
        assert parse_tool_calls(fmt, forced, [NUMS]) == (forced, [])
        obj = f"<tool_call>\n<function=f>\n<parameter=o>\n{body}\n</parameter>\n</function>\n</tool_call>"
        (call,) = parse_tool_calls(fmt, obj, [NUMS])[1]
        assert json.loads(call.arguments) == {"o": body}
