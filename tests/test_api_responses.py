"""The Responses API's input and reasoning control, without a server: input items as
chat messages, flat tools, ``text.format``, the refusals, and the efforts."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec
import pytest

from engine.text.chat import ChatTemplateError
from service.api.chat_output import ChatOutput
from service.api.generation import Piece
from service.api.openai.responses_answers import _Events, _head, output_items
from service.api.openai.responses_input import (
    chat_tool_choice,
    chat_tools,
    input_error,
    input_messages,
    responses_request,
    text_schema,
)
from service.api.openai.responses_schemas import ResponsesRequest
from service.api.openai.schemas import ChatMessageOut
from service.api.structured import response_schema
from service.api.thinking import EFFORT_BUDGETS, check_thinking, effort_thinking, ollama_thinking
from service.common.errors import APIError, decode_body


def _request(**body) -> object:
    decoded = msgspec.convert({"input": "Hi", **body}, ResponsesRequest)
    return responses_request(decoded, "resp_x", 0.0, 0)


def _refused(param: str, **body) -> str:
    with pytest.raises(APIError) as exc:
        _request(**body)
    assert exc.value.status == 400 and exc.value.param == param
    return exc.value.message


def test_input_items_become_chat_turns():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rainy"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ]
    messages = input_messages(items, "You are helpful.")
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[2]["content"] == "Weather?"
    call_turn = messages[3]
    assert call_turn["reasoning_content"] == "hm"
    assert [c["id"] for c in call_turn["tool_calls"]] == ["c1", "c2"]
    assert call_turn["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert input_messages("Hi", None) == [{"role": "user", "content": "Hi"}]


def test_an_unanswered_function_call_is_refused_not_dropped():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    message = _refused("input[1]", input=[{"role": "user", "content": "Hi"}, call])
    assert "no tool output found for function call 'c1'" in message and "function_call_output" in message


def test_an_output_answering_no_call_is_refused_not_rendered():
    """A ``function_call_output`` whose ``call_id`` no ``function_call`` before it made
    reached the chat template as a tool result answering nothing (chat completions
    refuses such a tool message): a 400 naming its call_id, as OpenAI refuses it."""
    hi = {"role": "user", "content": "Hi"}
    stray = {"type": "function_call_output", "call_id": "nope", "output": "42"}
    message = _refused("input[1].call_id", input=[hi, stray])
    assert "no function_call found for call_id 'nope'" in message, message
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    _refused("input[0].call_id", input=[answer, hi, call, answer])  # the call comes after its output
    assert input_messages([hi, call, answer], None)[2] == {"role": "tool", "tool_call_id": "c1", "content": "42"}


@pytest.mark.parametrize(
    ("content", "param", "code"),
    [(5, "input[0].content", "invalid_type"), ("hm", "input[0].content", "invalid_type"),
     ({"text": "hm"}, "input[0].content", "invalid_type"), ([5], "input[0].content[0]", "invalid_type"),
     ([{"type": "reasoning_text", "text": 5}], "input[0].content[0].text", "invalid_type"),
     ([{"type": "reasoning_text"}], "input[0].content[0].text", "missing_field")],
)
def test_a_reasoning_items_content_of_the_wrong_shape_is_refused(content, param, code):
    """A reasoning item's ``content`` of 5 was a 500 (``'int' object is not iterable``);
    a string, an object or parts without text were dropped unsaid. Now a 400 naming the
    field, with docs/api.md's code; absent or null it is still no text."""
    hi = {"role": "user", "content": "Hi"}
    with pytest.raises(APIError) as exc:
        input_messages([{"type": "reasoning", "content": content}, hi], None)
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, param, code), exc.value.message
    for fine in (None, [], [{"type": "reasoning_text", "text": "hm"}]):
        assert input_messages([{"type": "reasoning", "content": fine}, hi], None) == [hi]


def test_template_errors_name_the_input_item():
    """A chat template's refusal of a converted message names the Responses item it came
    from, not the chat message (``messages[i]``) it became."""
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rainy"},
    ]
    body = msgspec.convert({"input": items, "instructions": "Be brief."}, ResponsesRequest)
    tool = input_error(ChatTemplateError("messages[4].role 'tool' is not supported", "messages[4].role"), body)
    assert tool.status == 400 and tool.param == "input[4]"
    assert tool.message.startswith("input[4] is a function_call_output item") and "messages" not in tool.message
    call = input_error(ChatTemplateError("messages[2].tool_calls[1] is bad", "messages[2].tool_calls[1]"), body)
    assert call.param == "input[2]" and call.message == "input[2] (a function_call item) is bad"
    output = input_error(ChatTemplateError("messages[3].content is bad", "messages[3].content"), body)
    assert output.param == "input[3].output"
    system = input_error(ChatTemplateError("no", "messages[0]"), body)
    assert system.param == "instructions" and system.message == "instructions: no"
    whole = input_error(ChatTemplateError("cannot render these messages"), body)
    assert whole.param == "input"


def test_flat_tools_choice_and_text_format():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    assert json.loads(text_schema(fmt)) == schema
    assert text_schema({"format": {"type": "text"}}) is None
    assert json.loads(text_schema({"format": {"type": "json_object"}})) == {"type": "object"}
    call = _request(max_output_tokens=5, tools=[tool], tool_choice="auto", reasoning={"effort": "low"})
    assert call.max_tokens == 5 and call.max_tokens_param == "max_output_tokens"
    assert call.tools[0]["function"]["name"] == "f" and call.chat
    assert (call.thinking, call.thinking_budget) == (True, EFFORT_BUDGETS["low"])
    assert call.prompts[0].template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}  # gpt-oss reads it
    assert call.request_id.startswith("resp_")


def test_what_a_stateless_text_server_refuses():
    assert "stateless" in _refused("previous_response_id", previous_response_id="resp_1")
    assert "web_search" in _refused("tools[0]", tools=[{"type": "web_search"}])
    assert "vision" in _refused(
        "input[0].content[0]",
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}],
    )
    _refused("input[0]", input=[{"type": "item_reference", "id": "msg_1"}])
    _refused("input[0].role", input=[{"role": "tool", "content": "x"}])
    _refused("input", input=[])
    _refused("tool_choice", tool_choice={"type": "web_search"})
    _refused("text.format", text={"format": {"type": "xml"}})
    _refused("text.format", text={"format": {"type": "json_schema", "name": "x"}})
    _refused("reasoning.effort", reasoning={"effort": "extreme"})
    _refused("conversation", conversation="conv_1")
    # Accepted: store (nothing is stored), metadata, an effort of none.
    call = _request(store=True, metadata={"k": "v"}, reasoning={"effort": "none"})
    assert call.thinking is False and call.prompts[0].template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [("name", 5, "a string"), ("strict", "yes", "a boolean"), ("strict", 1, "a boolean"),
     ("description", ["d"], "a string")],
)
def test_a_json_schema_formats_fields_of_the_wrong_type_are_invalid_type(field, value, kind):
    """``name``, ``strict`` and ``description`` of a ``json_schema`` format were taken
    whatever their JSON type (``"strict": "yes"`` constrained as true): a 400
    ``invalid_type`` naming the field, on ``text.format`` and on chat's
    ``response_format`` alike; absent or null they are still taken."""
    schema = {"type": "object"}
    with pytest.raises(APIError) as exc:
        text_schema({"format": {"type": "json_schema", "name": "x", "schema": schema, field: value}})
    error = exc.value
    assert (error.status, error.param, error.code) == (400, f"text.format.{field}", "invalid_type")
    assert kind in error.message, error.message
    with pytest.raises(APIError) as exc:
        response_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, field: value}})
    error = exc.value
    assert (error.param, error.code) == (f"response_format.json_schema.{field}", "invalid_type")
    assert text_schema({"format": {"type": "json_schema", "schema": schema, field: None}}) == '{"type": "object"}'
    assert response_schema({"type": "json_schema", "json_schema": {"schema": schema}}) == '{"type": "object"}'


_HI = {"role": "user", "content": "Hi"}
_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "42"}


def _without(item: dict, field: str, **changed) -> dict:
    return {**{k: v for k, v in item.items() if k != field}, **changed}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"reasoning": {"effort": 5}}, "reasoning.effort", "invalid_type"),
        ({"text": {"format": "json"}}, "text.format", "invalid_type"),
        ({"text": {"format": {"type": 5}}}, "text.format.type", "invalid_type"),
        ({"tool_choice": 5}, "tool_choice", "invalid_type"),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"tools": [{"type": "function", "name": 5}]}, "tools[0].name", "invalid_type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "missing_field"),
        ({"input": [_HI, _without(_CALL, "call_id"), _OUTPUT]}, "input[1].call_id", "missing_field"),
        ({"input": [_HI, _without(_CALL, "x", call_id=5), _OUTPUT]}, "input[1].call_id", "invalid_type"),
        ({"input": [_HI, _without(_CALL, "name"), _OUTPUT]}, "input[1].name", "missing_field"),
        ({"input": [_HI, _without(_CALL, "x", name=5), _OUTPUT]}, "input[1].name", "invalid_type"),
        ({"input": [_HI, _without(_CALL, "x", arguments=5), _OUTPUT]}, "input[1].arguments", "invalid_type"),
        ({"input": [_HI, _CALL, _OUTPUT, _without(_OUTPUT, "call_id")]}, "input[3].call_id", "missing_field"),
        ({"input": [_HI, _CALL, _without(_OUTPUT, "x", call_id=["c1"])]}, "input[2].call_id", "invalid_type"),
        ({"input": [_HI, _CALL, _without(_OUTPUT, "x", call_id={"c": 1})]}, "input[2].call_id", "invalid_type"),
    ],
)
def test_a_field_of_the_wrong_json_type_is_invalid_type(body, param, code):
    """docs/api.md, Errors: a field of the wrong JSON type is ``invalid_type``, a
    required one absent ``missing_field``, ``param`` naming the nested field, as chat
    completions answers its ``reasoning_effort`` and ``response_format``. These were
    ``invalid_value`` (an item's ``call_id`` naming only ``input[i]``; one that was a
    list or an object a 500)."""
    raw = json.dumps({"model": "m", "input": "Hi", **body}).encode()
    with pytest.raises(APIError) as exc:
        responses_request(decode_body(raw, ResponsesRequest), "resp_x", 0.0, 0)
    error = exc.value
    assert (error.status, error.param, error.code) == (400, param, code), error.message
    assert param in error.message, error.message
    # Chat completions' response_format.type too (the same check).
    with pytest.raises(APIError) as exc:
        response_schema({"type": 5})
    assert (exc.value.param, exc.value.code) == ("response_format.type", "invalid_type")


@pytest.mark.parametrize(("summary", "code"), [("bogus", "invalid_value"), ("", "invalid_value"), (5, "invalid_type")])
def test_a_reasoning_summary_openai_does_not_define_is_refused(summary, code):
    """``reasoning.summary`` other than OpenAI's auto, concise and detailed was taken and
    ignored: a 400 naming it. Those (and null) are taken; no summary is made."""
    raw = json.dumps({"model": "m", "input": "Hi", "reasoning": {"summary": summary}}).encode()
    with pytest.raises(APIError) as exc:
        decode_body(raw, ResponsesRequest)
    error = exc.value
    assert (error.status, error.param, error.code) == (400, "reasoning.summary", code), error.message
    assert "reasoning.summary" in error.message
    for summary in ("auto", "concise", "detailed", None):
        raw = json.dumps({"model": "m", "input": "Hi", "reasoning": {"effort": "low", "summary": summary}}).encode()
        call = responses_request(decode_body(raw, ResponsesRequest), "resp_x", 0.0, 0)
        assert call.thinking is True


def test_efforts_and_think_levels():
    assert effort_thinking(None, "reasoning_effort") == (None, None)
    assert effort_thinking("none", "x") == effort_thinking("minimal", "x") == (False, None)
    assert effort_thinking("medium", "x") == (True, 4096)
    assert effort_thinking("high", "x") == (True, None)
    assert ollama_thinking(True) == (True, None) and ollama_thinking(False) == (False, None)
    assert ollama_thinking("low") == (True, 1024)
    with pytest.raises(APIError) as exc:
        ollama_thinking("max")
    assert exc.value.param == "think"
    # Thinking asked of a template that cannot think is refused; off is always fine.
    with pytest.raises(APIError) as exc:
        check_thinking(True, None, "{{ messages }}", "m", "think")
    assert exc.value.message == '"m" does not support thinking'
    check_thinking(False, None, "{{ messages }}", "m", "think")
    check_thinking(True, 5, "<think>{{ messages }}", "m", "think")
    with pytest.raises(APIError):
        check_thinking(None, 5, None, "m", "thinking_budget")


def test_output_items_of_an_answer():
    message = ChatMessageOut(role="assistant", content="Hi", reasoning_content="hm")
    message.tool_calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    items = output_items(message, "stop")
    assert [i.type for i in items] == ["reasoning", "message", "function_call"]
    assert items[2].call_id == "c1" and items[1].content[0].text == "Hi"
    assert output_items(ChatMessageOut(role="assistant", content="cut"), "length")[0].status == "incomplete"
    # No text and no calls: still one (empty) message.
    assert [i.type for i in output_items(ChatMessageOut(role="assistant", content=""), "stop")] == ["message"]


def test_a_cut_in_the_reasoning_leaves_the_reasoning_item_incomplete():
    """``max_output_tokens`` reached inside the thinking block: the reasoning item is
    ``incomplete``, as the response is (``incomplete_details.reason``
    ``max_output_tokens``); reasoning the answer went on from is ``completed``."""
    items = output_items(ChatMessageOut(role="assistant", content="", reasoning_content="hm"), "length")
    assert [(i.type, i.status) for i in items] == [("reasoning", "incomplete")]
    items = output_items(ChatMessageOut(role="assistant", content="Hi", reasoning_content="hm"), "length")
    assert [(i.type, i.status) for i in items] == [("reasoning", "completed"), ("message", "incomplete")]
    items = output_items(ChatMessageOut(role="assistant", content="", reasoning_content="hm"), "stop")
    assert [(i.type, i.status) for i in items] == [("reasoning", "completed")]
    events = asyncio.run(_streamed(["hm, ", "let me"], "length"))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("reasoning", "incomplete")]
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"].status == "incomplete"
    assert last["response"].incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in last["response"].output] == [("reasoning", "incomplete")]
    events = asyncio.run(_streamed(["hm", "</think>\n\nHi"], "length"))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("reasoning", "completed"), ("message", "incomplete")]


async def _streamed(texts: list[str], finish_reason: str) -> list[dict]:
    """The events of a streamed answer of ``texts`` that started inside a thinking
    block and ended with ``finish_reason``."""

    async def encode_text(text: str) -> list[int]:
        return list(range(len(text.split())))

    async def pieces():
        for j, text in enumerate(texts):
            yield Piece(0, text, finish_reason if j == len(texts) - 1 else None)

    gen = SimpleNamespace(
        request_id="resp_x", prompt_tokens=3, completion_tokens=len(texts), sampling=[],
        text=SimpleNamespace(encode_text=encode_text),
    )
    body = msgspec.convert({"input": "Hi", "max_output_tokens": len(texts)}, ResponsesRequest)
    events = _Events(gen, _head(body, gen, "m", 0), ChatOutput(n=1, thinking=True))
    return [e async for e in events.run(pieces())]
