"""gpt-oss's harmony answers on recorded model outputs (no server): the channels as
reasoning, content and tool calls, whole and streamed in pieces of any size (the stream,
put back together as the openai client does, equals the whole answer), malformed text
and a marker's cut start as plain content, forced calls, the prompt's continuation, and
an earlier turn's reasoning and call rendered back through a harmony template."""

from __future__ import annotations

import json
import random

import pytest
from test_api_tools import WEATHER, _replay

from engine.text.chat import render_chat
from service.api.chat_output import ChatOutput
from service.api.harmony import (
    THINKING_CLOSE,
    HarmonyCall,
    HarmonyParser,
    harmony_lead,
    plain,
    split_harmony,
    template_is_harmony,
)
from service.api.reasoning import template_thinks
from service.api.thinking import with_thinking
from service.api.tools import HARMONY, parse_tool_calls, parser_for_template, plan_tools
from service.common.errors import APIError

# A harmony chat template of this test suite's own, written the way gpt-oss's writes
# turns: a tool-call turn's reasoning in an analysis message before the call (the
# recipient in the role's header), tool results from ``functions.NAME``, earlier
# answers in the final channel, ``reasoning_effort`` in the system message; and, for the
# served tests, a generation prompt that opens the analysis message (``open_analysis``).
HARMONY_LIKE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort or 'medium' }}<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools{% for t in tools %}\n"
    "type {{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{% set last = namespace(name='') %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% set call = m.tool_calls[0].function %}{% set last.name = call.name %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary"
    "<|message|>{{ m.content | tojson }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant"
    "{% if open_analysis %}<|channel|>analysis<|message|>{% endif %}{% endif %}"
)
HARMONY_TOKENS = [
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>",
]

# Answers as gpt-oss writes them after the generation prompt's ``<|start|>assistant``.
THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
)
THINK_THEN_CALL = (
    "<|channel|>analysis<|message|>Need the weather in Paris: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
# The recipient after the role, as the template writes past calls; a preamble first.
PREAMBLE_THEN_CALL = (
    "<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Oslo"}<|call|>'
)


def test_channels_become_reasoning_content_and_calls():
    assert split_harmony(THINK_THEN_ANSWER) == (
        "The user greets; answer briefly.", "Hello! How can I help?", []
    )
    assert split_harmony(THINK_THEN_CALL) == (
        "Need the weather in Paris: call get_weather.", "", [HarmonyCall("get_weather", '{"city": "Paris"}')]
    )
    assert split_harmony(PREAMBLE_THEN_CALL) == (
        None, "Checking the forecast.", [HarmonyCall("get_weather", '{"city": "Oslo"}')]
    )
    # The recipient right after the generation prompt's role.
    assert split_harmony(' to=functions.get_weather<|channel|>commentary json<|message|>{}<|call|>')[2] == [
        HarmonyCall("get_weather", "{}")
    ]
    # The generation prompt's header, read first, shows nothing.
    assert split_harmony(THINK_THEN_ANSWER, "<|start|>assistant")[1] == "Hello! How can I help?"
    # No reasoning at all: None, as other formats answer.
    assert split_harmony("<|channel|>final<|message|>Hi.<|return|>") == (None, "Hi.", [])


@pytest.mark.parametrize("text", [THINK_THEN_ANSWER, THINK_THEN_CALL, PREAMBLE_THEN_CALL])
def test_any_cut_of_the_stream_gives_the_whole_answer(text):
    """Pieces of every size, and cuts at random places, markers split included."""
    want = split_harmony(text)
    cuts = [list(range(0, len(text), size)) for size in (1, 2, 3, 5, 8, 13)]
    rng = random.Random(3)
    cuts += [sorted({0, *rng.sample(range(1, len(text)), 9)}) for _ in range(20)]
    for starts in cuts:
        parser = HarmonyParser()
        ends = [*starts[1:], len(text)]
        parts = [parser.feed(text[a:b]) for a, b in zip(starts, ends, strict=True)]
        parts.append(parser.flush())
        reasoning = "".join(r for r, _ in parts)
        assert (reasoning or None, "".join(c for _, c in parts), parser.calls) == want
        # Reasoning and content go out as they come: none of the format's tokens in them.
        assert all("<|" not in r + c for r, c in parts)


def test_malformed_answers_are_plain_content_and_never_raise():
    # No header at all: a model that ignored the format.
    assert split_harmony("Just words, 3 < 4.") == (None, "Just words, 3 < 4.", [])
    # A header that is not one (other tokens in it): the rest is content, tokens left out.
    assert split_harmony("<|channel|>final<|return|>oops") == (None, "finaloops", [])
    # Text after a message that does not open another: content.
    assert split_harmony("<|channel|>analysis<|message|>hm<|end|>stray<|return|>") == ("hm", "stray", [])
    # Whitespace between messages is no text of either.
    assert split_harmony("<|channel|>analysis<|message|>a<|end|>\n<|start|>assistant<|channel|>final<|message|>b") == (
        "a", "b", []
    )
    # A header that never ends.
    long = "<|channel|>" + "x" * 300
    assert split_harmony(long) == (None, "x" * 300, [])
    # A call whose arguments are not JSON (cut by max_tokens): its text is content.
    cut = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa'
    assert split_harmony(cut) == (None, '{"city": "Pa', [])
    # Fragments of every marker in any order: some answer, never an exception.
    rng = random.Random(5)
    pieces = [*HARMONY_TOKENS, "<|", "|>", "analysis", "final", " to=functions.f", "{}", "x", "<|endoftext|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        reasoning, content, calls = split_harmony(text)
        assert isinstance(content, str) and all(json.loads(c.arguments) is not None for c in calls)


# Answers cut by max_tokens after the generation prompt: (answer, its content). A
# marker's cut start is text the model wrote, no token: content; a header's whole
# tokens and words are not text.
CUT_ANSWERS = [
    ("<|", "<|"),
    ("<", "<"),
    ("<|channel", "<|channel"),
    ("<|channel|>final<|mess", "<|mess"),
    ("<|channel|>final<|message|>Hi<|", "Hi<|"),
    ("<|channel|>final<|message|>Hi<|end|><|start|>assistant", "Hi"),
    ("<|channel|>final<|message|>Hi<|end|><|start|>assistant<|chan", "Hi<|chan"),
    ("<|channel|>final", ""),
]


@pytest.mark.parametrize(("text", "content"), CUT_ANSWERS)
def test_a_cut_marker_reaches_the_user_as_content(text, content):
    for primer in ("", "<|start|>assistant"):
        assert split_harmony(text, primer) == (None, content, [])
    # Streamed in pieces of any size, through the chat output as the server sends it.
    for size in (1, 2, 5):
        parser = HarmonyParser()
        parts = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
        assert "".join(c for _, c in [*parts, parser.flush()]) == content
        streamed = _replay(ChatOutput(n=1, harmony=True, primer="<|start|>assistant"), text, size, "length")
        assert (streamed["content"], streamed["finish"]) == (content, ["length"])
    message, _ = ChatOutput(n=1, harmony=True, primer="<|start|>assistant").message(text, "length")
    assert message.content == content


@pytest.mark.parametrize("text", ["Hello there", "Sure." * 60, "assistant says hi"])
def test_an_answer_with_no_harmony_header_is_content(text):
    """A model that ignores the format after the prompt's ``<|start|>assistant`` (short,
    or past the longest header) gives its text as content, none of the prompt's role
    glued to it, whole and streamed; a short one streams from its first piece instead
    of waiting for a header that never comes."""
    primer = "<|start|>assistant"
    assert split_harmony(text, primer) == (None, text, [])
    for size in (1, 3, 1000):
        streamed = _replay(ChatOutput(n=1, harmony=True, primer=primer), text, size, "stop")
        assert streamed["content"] == text
    parser = HarmonyParser()
    parser.prime(primer)
    assert parser.feed(text[:5]) == ("", text[:5])


def test_template_and_parser_are_recognized():
    assert template_is_harmony(HARMONY_LIKE) and not template_is_harmony("<|im_start|>{{ tools }}")
    assert parser_for_template(HARMONY_LIKE) == HARMONY
    assert template_thinks(HARMONY_LIKE)
    content, calls = parse_tool_calls(HARMONY, THINK_THEN_CALL)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert plain("<|channel|>final<|message|>Hi<|return|>") == "finalHi"


@pytest.mark.parametrize("size", [1, 4, 17, 1000])
def test_chat_output_whole_and_streamed(size):
    plan = plan_tools([WEATHER], None, HARMONY_LIKE, True)
    assert plan.parse == HARMONY
    whole, reason = ChatOutput(n=1, tools=plan, harmony=True).message(THINK_THEN_CALL, "stop")
    assert reason == "tool_calls" and whole.content is None
    assert whole.reasoning_content == "Need the weather in Paris: call get_weather."
    assert [c["function"] for c in whole.tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    streamed = _replay(ChatOutput(n=1, tools=plan, harmony=True), THINK_THEN_CALL, size)
    assert streamed["finish"] == ["tool_calls"]
    assert streamed["reasoning_content"] == whole.reasoning_content and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    answer = _replay(ChatOutput(n=1, harmony=True), THINK_THEN_ANSWER, size)
    assert answer["content"] == "Hello! How can I help?" and answer["finish"] == ["stop"]
    message, reason = ChatOutput(n=1, harmony=True).message(THINK_THEN_ANSWER, "stop")
    assert (message.reasoning_content, message.content, reason) == (
        "The user greets; answer briefly.", "Hello! How can I help?", "stop"
    )
    # tool_choice none: a call the model makes anyway is what it wrote, as content.
    none = plan_tools([WEATHER], "none", HARMONY_LIKE, True)
    message, reason = ChatOutput(n=1, tools=none, harmony=True).message(THINK_THEN_CALL, "stop")
    assert message.content == '{"city": "Paris"}' and not message.tool_calls and reason == "stop"


def test_forced_calls():
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools([WEATHER], named, HARMONY_LIKE, True)
    assert plan.prefix == "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert json.loads(plan.schema) == WEATHER["function"]["parameters"] and plan.suffix == "<|call|>"
    # The grammar lets the JSON through, then an end token (or none: max_tokens).
    for written in ('{"city": "Rome"}<|call|>', '{"city": "Rome"}'):
        message, reason = ChatOutput(n=1, tools=plan, harmony=True).message(written, "stop")
        assert reason == "tool_calls" and message.tool_calls[0]["function"]["arguments"] == '{"city": "Rome"}'
        streamed = _replay(ChatOutput(n=1, tools=plan, harmony=True), written, 3)
        assert streamed["finish"] == ["tool_calls"] and streamed["content"] == ""
    # Cut before its JSON closes: the model's text, finish "length", as other formats.
    message, reason = ChatOutput(n=1, tools=plan, harmony=True).message('{"city": "Ro', "length")
    assert (message.content, reason) == ('{"city": "Ro', "length") and not message.tool_calls
    # required: one tool is that tool's call; several cannot name one outside the grammar.
    assert plan_tools([WEATHER], "required", HARMONY_LIKE, True).prefix == plan.prefix
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with pytest.raises(APIError) as refused:
        plan_tools([WEATHER, other], "required", HARMONY_LIKE, True)
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize("name", ["get weather", "get_weather\n", "a<b"])
def test_a_tool_name_the_call_header_cannot_carry_is_refused(name):
    """Any tool_choice: forced, the call's header holds the name; auto, the model's call
    would be read back as another function."""
    tool = {"type": "function", "function": {**WEATHER["function"], "name": name}}
    named = {"type": "function", "function": {"name": name}}
    for choice in (named, "required", "auto", None, "none"):
        with pytest.raises(APIError) as refused:
            plan_tools([tool] if choice == "required" else [tool, WEATHER], choice, HARMONY_LIKE, True)
        error = refused.value
        assert (error.status, error.type, error.param) == (400, "invalid_request_error", "tools[0].function.name")
        assert repr(name) in error.message and "to=functions.NAME" in error.message
    # Names the header carries: dots and colons (MCP's) as well as OpenAI's own.
    for fine in ("server.get_weather", "mcp:get-weather"):
        tool = {"type": "function", "function": {**WEATHER["function"], "name": fine}}
        plan = plan_tools([tool], {"type": "function", "function": {"name": fine}}, HARMONY_LIKE, True)
        message, _ = ChatOutput(n=1, tools=plan, harmony=True).message('{"city": "Rome"}', "stop")
        assert message.tool_calls[0]["function"]["name"] == fine


def test_prompt_continuations():
    """What the server writes after the prompt: nothing more in a header; a body the
    prompt opened is closed first. The budget's close leads into the final message."""
    in_header, in_analysis = HarmonyParser(), HarmonyParser()
    in_header.feed("<|start|>assistant")
    in_analysis.feed("<|start|>assistant<|channel|>analysis<|message|>")
    assert harmony_lead(in_header) == "" and not in_header.in_reasoning
    assert harmony_lead(in_analysis) == "<|end|><|start|>assistant" and in_analysis.in_reasoning
    reasoning, content, _ = split_harmony("hm" + THINKING_CLOSE + "Hi.", "<|start|>assistant<|channel|>analysis<|message|>")
    assert (reasoning, content) == ("hm", "Hi.")
    assert with_thinking(None, True, "high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert with_thinking({"reasoning_effort": "low"}, None, "high") == {"reasoning_effort": "low"}
    assert with_thinking(None, False, "none") == {"enable_thinking": False}


def test_an_earlier_turn_with_reasoning_and_a_call_renders_back(smollm_tokenizer):
    """The answer's message, sent back as the client got it (with the call's result),
    renders its reasoning and its call in the prompt; Ollama's and Anthropic's name
    for the reasoning (``thinking``) reach the template alike."""
    plan = plan_tools([WEATHER], None, HARMONY_LIKE, True)
    message, _ = ChatOutput(n=1, tools=plan, harmony=True).message(THINK_THEN_CALL, "stop")
    call = message.tool_calls[0]
    original = smollm_tokenizer.chat_template
    smollm_tokenizer.chat_template = HARMONY_LIKE
    try:
        for key in ("reasoning_content", "thinking", "reasoning"):
            history = [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, key: message.reasoning_content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
            ]
            prompt = render_chat(smollm_tokenizer, history, tools=[WEATHER], template_kwargs={"reasoning_effort": "low"})
            assert prompt.endswith(
                "<|start|>assistant<|channel|>analysis<|message|>Need the weather in Paris: call get_weather.<|end|>"
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
                '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
                "<|start|>assistant"
            ), prompt
            assert "Reasoning: low" in prompt
    finally:
        smollm_tokenizer.chat_template = original
