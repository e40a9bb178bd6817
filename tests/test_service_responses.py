"""OpenAI's Responses API and reasoning control through a real ``headroom serve``, with
the official ``openai`` client: the default model (no tools, no thinking) for plain
answers, streams, ``text.format`` and the refusals; the tiny thinking Qwen3
(``qwen3_server``, :mod:`thinking_server`) for function calls, reasoning items and
thinking budgets on every API."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import ollama
import openai
import pytest
from service_harness import ServerProcess
from test_api_tools import WEATHER

pytestmark = pytest.mark.slow

ASK = "Is Paris in France? Answer briefly."
GREEDY = {"max_output_tokens": 12, "temperature": 0}
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
YES_NO = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)


def _bad_request(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    body = exc.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    return body["message"]


def test_plain_and_streamed_answers_agree(real_server):
    client = _client(real_server)
    whole = client.responses.create(model="default", input=ASK, instructions="Be brief.", **GREEDY)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status in ("completed", "incomplete") and whole.output_text
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = whole.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(
        client.responses.create(model="default", input=ASK, instructions="Be brief.", stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]
    ends = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:] == [*ends, "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == usage.output_tokens


def test_stream_events_are_named_server_sent_events(real_server):
    """Named events, sent as Server-Sent Events that no cache or proxy holds back."""
    body = {"input": "Hi", "stream": True, **GREEDY}
    with real_server.client(timeout=300) as http:
        resp = http.post("/v1/responses", json=body)
    text = resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert (resp.headers["cache-control"], resp.headers["x-accel-buffering"]) == ("no-cache", "no")
    frames = [f for f in text.split("\n\n") if f.strip()]
    for frame in frames:
        event, data = frame.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert "[DONE]" not in text


def test_json_schema_answer_validates(real_server):
    client = _client(real_server)
    fmt = {"format": {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}}
    for seed in range(2):
        reply = client.responses.create(
            model="default", input=ASK, text=fmt, max_output_tokens=32, temperature=1.0, extra_body={"seed": seed}
        )
        assert reply.status == "completed", reply.output_text
        jsonschema_rs.validate(YES_NO, json.loads(reply.output_text))


def test_text_format_errors_speak_of_text_format(real_server):
    """A refused ``text.format`` names Responses' own shape and field in its message, not
    chat completions' ``response_format`` (whose shape nests the schema differently)."""
    client = _client(real_server)

    def refused(fmt: dict) -> str:
        return _bad_request(lambda: client.responses.create(
            model="default", input="Hi", text={"format": fmt}, max_output_tokens=4), "text.format")

    no_schema = refused({"type": "json_schema", "name": "x"})
    assert "response_format" not in no_schema and '"type": "json_schema", "name": ..., "schema": {...}' in no_schema
    assert "response_format" not in refused({"type": "yaml"})
    unenforceable = refused({"type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}})
    assert unenforceable.startswith("text.format: ") and "uniqueItems" in unenforceable


def test_refusals_in_openai_error_shape(real_server):
    client = _client(real_server)
    message = _bad_request(
        lambda: client.responses.create(model="default", input="Hi", previous_response_id="resp_1"),
        "previous_response_id",
    )
    assert "stateless" in message
    _bad_request(lambda: client.responses.create(model="default", input="Hi", tools=[{"type": "web_search"}]), "tools[0]")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]
    _bad_request(lambda: client.responses.create(model="default", input=image), "input[0].content[0]")
    _bad_request(lambda: client.responses.create(model="default", input="Hi", tools=[FLAT_WEATHER]), "tools")
    with real_server.client(timeout=60) as http:
        for raw in (b"{", b'{"input": 3}', b"{}"):
            r = http.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tool_items_refused_in_the_responses_terms(real_server):
    """On a model without tool support a function_call_output is refused naming its input
    item and type (not the chat message it becomes); a function_call no output answers,
    and an output answering no call, are refused as OpenAI refuses them, not dropped."""
    client = _client(real_server)
    output = [{"type": "function_call_output", "call_id": "c1", "output": "42"}]
    message = _bad_request(lambda: client.responses.create(model="default", input=output), "input[0].call_id")
    assert "no function_call found for call_id 'c1'" in message
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    message = _bad_request(lambda: client.responses.create(model="default", input=[call]), "input[0]")
    assert "no tool output found for function call 'c1'" in message
    ask = [{"role": "user", "content": "Hi"}, call, output[0]]
    message = _bad_request(lambda: client.responses.create(model="default", input=ask), "input[2]")
    assert message.startswith("input[2] is a function_call_output item") and "tool support" in message
    assert "messages" not in message and "'tool'" not in message
    too_long = "word " * 200_000
    message = _bad_request(lambda: client.responses.create(model="default", input=too_long), "input")
    assert "maximum context length" in message


def test_a_model_that_cannot_think_refuses_thinking_but_not_its_absence(real_server):
    client = _client(real_server)
    message = _bad_request(
        lambda: client.responses.create(model="default", input="Hi", reasoning={"effort": "high"}),
        "reasoning.effort",
    )
    assert message == '"default" does not support thinking'
    _bad_request(
        lambda: client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="low"
        ),
        "reasoning_effort",
    )
    off = client.responses.create(model="default", input="Hi", reasoning={"effort": "none"}, **GREEDY)
    assert off.output_text
    # A summary is taken (none is made) and echoed, but only as OpenAI defines it.
    summed = client.responses.create(model="default", input="Hi", reasoning={"summary": "auto"}, **GREEDY)
    assert summed.reasoning.summary == "auto" and summed.output_text
    _bad_request(lambda: client.responses.create(model="default", input="Hi", reasoning={"summary": "bogus"}),
                 "reasoning.summary")
    chat_off = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="none", max_tokens=4
    )
    assert chat_off.choices[0].message.content is not None
    # A budget of 0 asks for no thinking: taken as none is.
    zero = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body={"thinking_budget": 0}
    )
    assert zero.choices[0].message.content is not None
    local = ollama.Client(host=real_server.base_url, timeout=300)
    for think in (True, "high"):
        with pytest.raises(ollama.ResponseError) as exc:
            local.chat(model="default", messages=[{"role": "user", "content": "Hi"}], think=think)
        assert exc.value.status_code == 400 and exc.value.error == '"default" does not support thinking'
    with pytest.raises(ollama.ResponseError) as exc:
        local.generate(model="default", prompt="Hi", think=True)
    assert exc.value.status_code == 400
    assert local.generate(model="default", prompt="Hi", think=False, options={"num_predict": 4}).response


def test_function_call_and_its_output(qwen3_server):
    client = _client(qwen3_server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    forced = client.responses.create(
        model="default", input=ask, tools=[FLAT_WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
    )
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(call.arguments))
    events = list(client.responses.create(
        model="default", input=ask, tools=[FLAT_WEATHER], tool_choice="required", max_output_tokens=64, stream=True,
    ))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(events[-1].response.output[0].arguments)
    follow_up = [*ask, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answered = client.responses.create(model="default", input=follow_up, tools=[FLAT_WEATHER], **GREEDY)
    assert answered.status in ("completed", "incomplete") and answered.usage.input_tokens > forced.usage.input_tokens


def test_reasoning_items_and_effort(qwen3_server):
    client = _client(qwen3_server)
    # ignore_eos: the answer runs to max_output_tokens, all of it reasoning.
    high = {"reasoning": {"effort": "high"}, "extra_body": {"ignore_eos": True}, **GREEDY}
    thought = client.responses.create(model="default", input="Hi", **high)
    (reasoning,) = thought.output  # the prompt opened <think>: every token is reasoning
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text and thought.usage.output_tokens_details.reasoning_tokens > 0
    # Cut inside the reasoning: the reasoning, like the response, is incomplete.
    assert (reasoning.status, thought.status, thought.incomplete_details.reason) == (
        "incomplete", "incomplete", "max_output_tokens")
    events = list(client.responses.create(model="default", input="Hi", stream=True, **high))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas.strip() == reasoning.content[0].text
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
    off = client.responses.create(model="default", input="Hi", reasoning={"effort": "none"}, **GREEDY)
    assert [i.type for i in off.output] == ["message"] and off.usage.input_tokens > thought.usage.input_tokens
    # A reasoning item sent back is accepted (its text is the template's to use).
    history = [
        {"role": "user", "content": "Hi"},
        reasoning.model_dump(exclude_none=True),
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    again = client.responses.create(model="default", input=history, **GREEDY)
    assert again.status in ("completed", "incomplete")


def test_thinking_budget_closes_the_block(qwen3_server):
    client = _client(qwen3_server)
    hi = [{"role": "user", "content": "Hi"}]
    greedy = {"max_tokens": 16, "temperature": 0}
    free = client.chat.completions.create(model="default", messages=hi, extra_body={"ignore_eos": True}, **greedy)
    unlimited = free.choices[0].message.model_extra["reasoning_content"]
    assert unlimited and not free.choices[0].message.content  # all 16 tokens are reasoning
    capped = client.chat.completions.create(
        model="default", messages=hi, extra_body={"ignore_eos": True, "thinking_budget": 3}, **greedy
    )
    message = capped.choices[0].message
    # The first 3 tokens are the same reasoning; then </think> is forced and the answer goes on.
    assert unlimited.startswith(message.model_extra["reasoning_content"])
    assert len(message.model_extra["reasoning_content"]) < len(unlimited) and message.content
    none = client.chat.completions.create(
        model="default", messages=hi, reasoning_effort="none", extra_body={"ignore_eos": True}, **greedy
    )
    assert none.choices[0].message.content and not none.choices[0].message.model_extra.get("reasoning_content")
    local = ollama.Client(host=qwen3_server.base_url, timeout=300)
    options = {"temperature": 0, "num_predict": 6}
    low = local.chat(model="default", messages=hi, think="low", options=options)
    assert low.message.thinking and not low.message.content
    generated = local.generate(model="default", prompt="Hi", think=True, options=options)
    assert generated.thinking and not generated.response
    with httpx.Client(base_url=qwen3_server.base_url, timeout=60) as http:
        bad = http.post("/api/chat", json={"model": "default", "messages": hi, "think": "max"})
    assert bad.status_code == 400 and "think" in bad.json()["error"]


def test_a_budget_beyond_any_context_is_no_limit(qwen3_server):
    """A thinking budget larger than a 64-bit integer is a budget no sequence reaches:
    answered as no limit, never a 500 from passing it to the worker."""
    hi = [{"role": "user", "content": "Hi"}]
    huge = 2**70
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:
        chat = http.post("/v1/chat/completions", json={
            "model": "default", "messages": hi, "max_tokens": 6, "temperature": 0, "thinking_budget": huge})
        messages = http.post("/v1/messages", json={
            "model": "default", "messages": hi, "max_tokens": huge + 1, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": huge}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["reasoning_content"]
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["type"] == "thinking"
