"""Reasoning, chat_template_kwargs and tools through a real ``headroom serve``, with the
official openai client: a tiny random-weight Qwen3 whose template has tools and
thinking (``qwen3_server``, :mod:`thinking_server`), and the default model, whose
template has no tool support."""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from service_harness import ServerProcess
from test_api_tools import WEATHER

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)


def test_reasoning_content_whole_and_streamed(qwen3_server):
    client = _client(qwen3_server)
    whole = client.chat.completions.create(model="default", messages=HI, **GREEDY)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not message.content  # the prompt opened <think>: all reasoning
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(
        model="default", messages=HI, stream=True, **GREEDY
    ):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            streamed["reasoning_content"] += extra.get("reasoning_content") or ""
            streamed["content"] += choice.delta.content or ""
    # The whole answer's reasoning loses the whitespace around it; a stream cannot.
    assert streamed["reasoning_content"].strip() == reasoning and streamed["content"] == ""


def test_chat_template_kwargs_reach_the_template(qwen3_server):
    client = _client(qwen3_server)
    thinking = client.chat.completions.create(model="default", messages=HI, **GREEDY)
    off = client.chat.completions.create(
        model="default",
        messages=HI,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    # The empty block the template closes is in the prompt; the answer is content.
    assert off.usage.prompt_tokens > thinking.usage.prompt_tokens
    assert off.choices[0].message.content
    assert not off.choices[0].message.model_extra.get("reasoning_content")


def test_tools_and_tool_messages_reach_the_template(qwen3_server):
    client = _client(qwen3_server)
    plain = client.chat.completions.create(model="default", messages=HI, **GREEDY)
    with_tools = client.chat.completions.create(
        model="default", messages=HI, tools=[WEATHER], tool_choice="none", **GREEDY
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    answered = client.chat.completions.create(
        model="default", messages=history, tools=[WEATHER], **GREEDY
    )
    assert answered.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # Forced calls (named, required) come out valid even from random weights: the
    # arguments are grammar-constrained to the function's parameters. The thinking
    # block the prompt opened is closed first, so none of it is reasoning.
    schema = WEATHER["function"]["parameters"]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        for seed in range(3):
            forced = client.chat.completions.create(
                model="default",
                messages=HI,
                tools=[WEATHER],
                tool_choice=choice,
                max_tokens=64,
                temperature=1.0,
                seed=seed,
            )
            out = forced.choices[0]
            assert out.finish_reason == "tool_calls", out
            assert not out.message.model_extra.get("reasoning_content")
            call = out.message.tool_calls[0]
            assert call.function.name == "get_weather"
            jsonschema_rs.validate(schema, json.loads(call.function.arguments))
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="default",
            messages=HI,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert exc.value.body["param"] == "tool_choice"


def test_a_forced_call_cut_by_max_tokens_answers_alike_streamed_or_not(qwen3_server):
    """A forced call cut before its JSON closes: the same content (the model's text, no
    ``<tool_call>`` it never wrote), no tool_calls and ``length``, streamed or not."""
    client = _client(qwen3_server)
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        ask = {"model": "default", "messages": HI, "tools": [WEATHER], "tool_choice": choice,
               "max_tokens": 3, "temperature": 0}
        whole = client.chat.completions.create(**ask).choices[0]
        assert whole.finish_reason == "length" and not whole.message.tool_calls, whole
        assert whole.message.content and "<tool_call>" not in whole.message.content
        content, finishes, calls = "", [], []
        for chunk in client.chat.completions.create(stream=True, **ask):
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finishes += [c.finish_reason] if c.finish_reason else []
        assert (content, finishes, calls) == (whole.message.content, ["length"], [])


def test_a_forced_call_whose_parameters_the_grammar_cannot_enforce_is_a_400(qwen3_server):
    """Fail closed for a forced call too: its function's ``parameters`` are the schema,
    so the 400 names ``tools``."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError) as exc:
        _client(qwen3_server).chat.completions.create(
            model="default", messages=HI, tools=[tool], tool_choice="required", max_tokens=8)
    assert exc.value.body["param"] == "tools" and "uniqueItems" in exc.value.body["message"]


def test_parameters_that_are_not_a_schema_object_are_a_400(qwen3_server):
    """A function's ``parameters`` must be a JSON schema object: a string is refused
    naming the field, not replaced by ``{"type": "object"}`` behind the client's back."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": "not a schema"}}
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError) as exc:
            _client(qwen3_server).chat.completions.create(
                model="default", messages=HI, tools=[tool], tool_choice=choice, max_tokens=4)
        assert exc.value.body["param"] == "tools[0].function.parameters"


def test_two_tools_of_one_name_are_a_400_on_every_api(qwen3_server):
    """A call names its function, so two tools of one name could never be told apart:
    refused naming the second, as OpenAI and Anthropic refuse them; and a tool of no
    name could never be called: refused naming it."""
    import httpx

    schema = {"type": "object"}
    openai_tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:
        chat = http.post("/v1/chat/completions", json={
            "messages": HI, "tools": [openai_tool, openai_tool], "tool_choice": "required", "max_tokens": 4})
        messages = http.post("/v1/messages", json={
            "model": "default", "messages": HI, "max_tokens": 4, "tool_choice": {"type": "any"},
            "tools": [{"name": "pick", "input_schema": schema}] * 2})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "tools[1]", chat.text
    assert "pick" in chat.json()["error"]["message"]
    assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error", messages.text
    assert "pick" in messages.json()["error"]["message"]
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:  # nor can a tool of no name
        nameless = http.post("/v1/chat/completions", json={
            "messages": HI, "tools": [{"type": "function", "function": {"name": " ", "parameters": schema}}],
            "tool_choice": "required", "max_tokens": 4})
    assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "tools[0]", nameless.text
    assert "needs a name" in nameless.json()["error"]["message"]


def test_tool_names_openai_refuses_are_a_400_naming_the_tool(qwen3_server):
    """A function's name must match OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``, on chat
    completions and Responses alike."""
    import httpx

    parameters = WEATHER["function"]["parameters"]
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:
        for name in ("get weather", 'say "hi"', "x" * 65):
            chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "tools": [
                WEATHER, {"type": "function", "function": {"name": name, "parameters": parameters}}]})
            responses = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "tools": [
                {"type": "function", "name": name, "parameters": parameters}]})
            for r, param in ((chat, "tools[1].function.name"), (responses, "tools[0].name")):
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == param and error["type"] == "invalid_request_error", error
                assert repr(name) in error["message"] and "^[a-zA-Z0-9_-]{1,64}$" in error["message"], error
        fine = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "tools": [
            {"type": "function", "function": {"name": "get-Weather_2", "parameters": parameters}}]})
        assert fine.status_code == 200, fine.text


def test_past_call_arguments_as_an_object_or_as_text_that_is_not_json(qwen3_server):
    """A past call's ``arguments`` as an object renders as its JSON text does; text
    that is not JSON is a 400 naming it, not a malformed call shown to the model."""
    client = _client(qwen3_server)

    def asked(arguments) -> list[dict]:
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    def prompt_tokens(arguments) -> int:
        answer = client.chat.completions.create(model="default", messages=asked(arguments), tools=[WEATHER],
                                                **{**GREEDY, "max_tokens": 1})
        return answer.usage.prompt_tokens

    assert prompt_tokens({"city": "Paris"}) == prompt_tokens('{"city": "Paris"}')
    with pytest.raises(openai.BadRequestError) as exc:
        prompt_tokens("city=Paris")
    assert exc.value.body["param"] == "messages[1].tool_calls[0].function.arguments", exc.value.body
    assert "is not JSON" in exc.value.body["message"], exc.value.body
    # Text of JSON that is no object, or not JSON at all (NaN), and a raw value that is
    # no string nor object: refused naming the field, as OpenAI refuses them; so is a
    # past call's name that a tool could not have.
    import httpx

    param = "messages[1].tool_calls[0].function"
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:
        for arguments, said in (("[1, 2]", "is JSON of list, not an object"), ("1", "is JSON of int, not an object"),
                                ("null", "is JSON of null, not an object"), ("NaN", "is not JSON"),
                                ('{"x": NaN}', "is not JSON"), ([1, 2], "must be a string"), (1, "must be a string"),
                                (None, "must be a string")):
            r = http.post("/v1/chat/completions", json={"messages": asked(arguments), "tools": [WEATHER], "max_tokens": 1})
            assert r.status_code == 400, (arguments, r.text)
            error = r.json()["error"]
            assert error["param"] == f"{param}.arguments" and said in error["message"], (arguments, error)
        history = asked("{}")
        history[1]["tool_calls"][0]["function"]["name"] = "get weather"
        r = http.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"{param}.name", r.text
        assert "^[a-zA-Z0-9_-]{1,64}$" in r.json()["error"]["message"], r.text
        # The same rules on a Responses function_call item.
        for field, value, said in (("arguments", "[1, 2]", "not an object"), ("name", "get weather", "not allowed")):
            call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", field: value}
            r = http.post("/v1/responses", json={"max_output_tokens": 1, "input": [
                {"role": "user", "content": "Hi"}, call, {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == f"input[1].{field}", r.text
            assert said in r.json()["error"]["message"], r.text


def test_tool_messages_answer_the_calls_right_before_them(qwen3_server):
    """Each tool message answers a call of the assistant message right before its run of
    tool messages, each call once, call ids unique: else a 400 in OpenAI's words naming
    the message at fault."""
    import httpx

    def assistant(*ids: str) -> dict:
        calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for i in ids]
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def tool(call_id: str) -> dict:
        return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}

    stray = "messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
    fine = [*HI, assistant("c1", "c2"), tool("c2"), tool("c1"), *HI, assistant("c3"), tool("c3")]
    refused = (
        ([*HI, tool("c1")], "messages[1]", stray),
        ([*HI, assistant("c1"), tool("c2")], "messages[2]", stray),
        ([*HI, assistant("c1"), tool("c1"), *HI, tool("c1")], "messages[4]", stray),  # a call two turns back
        ([*HI, assistant("c1", "c2"), tool("c1"), *HI], "messages[1]",
         "an assistant message with 'tool_calls' must be followed by tool messages responding to each "
         "'tool_call_id'; these tool_call_ids of messages[1] have no response message: 'c2'"),
        ([*HI, assistant("c1"), tool("c1"), tool("c1")], "messages[3]", "tool_call_id 'c1' is answered twice"),
        ([*HI, assistant("c1"), tool("c1"), assistant("c1"), tool("c1")], "messages[3].tool_calls[0]",
         "tool_call id 'c1' is given twice"),
    )
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:
        ok = http.post("/v1/chat/completions", json={"messages": fine, "tools": [WEATHER], "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        for messages, param, said in refused:
            r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 1})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["message"].startswith(said), error


def test_tool_choice_errors_say_what_is_wrong_and_allowed_tools_limit_the_call(qwen3_server):
    """A tool_choice of the wrong shape is named as such (not as a function missing
    from tools); ``allowed_tools`` of mode ``required`` (chat's and Responses' shape)
    forces a call to one of the tools it lists; of mode ``auto`` it is refused."""
    import httpx

    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with httpx.Client(base_url=qwen3_server.base_url, timeout=300) as http:
        def chat(choice, tools=(WEATHER,), **more) -> httpx.Response:
            return http.post("/v1/chat/completions", json={
                "messages": HI, "tools": list(tools), "tool_choice": choice, "max_tokens": 64, **more})

        for choice, said in (
            ({"type": "function", "name": "get_weather"}, "tool_choice.function.name is missing: expected {type: "
             "function, function: {name}} (a name beside type is the Responses API's shape)"),
            ({"type": "function"}, "tool_choice.function.name is missing: expected {type: function, function: {name}}"),
            ({"type": "function", "function": {"name": "nope"}},
             "tool_choice names the function 'nope', which is not among tools (get_weather)"),
            ({"type": "nope"}, "tool_choice type 'nope' is not supported"),
            ({"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": [WEATHER]}},
             "tool_choice.allowed_tools must be {mode: 'auto' | 'required'"),
            ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [other]}},
             "tool_choice.allowed_tools.tools[0] names the function 'get_time', which is not among tools"),
        ):
            r = chat(choice)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "tool_choice" and error["message"].startswith(said), error
        allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [WEATHER]}}
        for seed in range(3):  # random weights; the grammar takes only the allowed tool
            r = chat(allowed, (other, WEATHER), temperature=1.0, seed=seed)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"], choice
        auto = chat({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [WEATHER]}})
        assert auto.status_code == 400 and "mode 'auto' is not supported" in auto.json()["error"]["message"], auto.text
        r = http.post("/v1/responses", json={
            "input": "Hi", "max_output_tokens": 64, "tools": [{"type": "function", "name": "get_time"},
                                                             {"type": "function", **WEATHER["function"]}],
            "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}})
        assert r.status_code == 200, r.text
        assert [i["name"] for i in r.json()["output"] if i["type"] == "function_call"] == ["get_weather"], r.text


def test_template_without_tools_is_a_400(real_server):
    client = _client(real_server)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="default", messages=HI, tools=[WEATHER])
    assert exc.value.body["param"] == "tools"
    assert "no tool support" in exc.value.body["message"]
    # A malformed request is named as such first, before what the model cannot do.
    for choice in ("banana", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="default", messages=HI, tools=[WEATHER], tool_choice=choice)
        assert exc.value.body["param"] == "tool_choice", exc.value.body
        assert "no tool support" not in exc.value.body["message"], exc.value.body


def test_ollama_thinking_and_tools(qwen3_server):
    import ollama

    client = ollama.Client(host=qwen3_server.base_url, timeout=300)
    options = {"temperature": 0, "num_predict": 6}
    whole = client.chat(model="default", messages=HI, options=options)
    assert whole.message.thinking and not whole.message.content
    streamed = "".join(
        p.message.thinking or ""
        for p in client.chat(model="default", messages=HI, options=options, stream=True)
    )
    assert streamed.strip() == whole.message.thinking
    off = client.chat(model="default", messages=HI, options=options, think=False)
    assert off.message.content and not off.message.thinking
    with_tools = client.chat(model="default", messages=HI, options=options, tools=[WEATHER])
    assert with_tools.prompt_eval_count > whole.prompt_eval_count
    shown = client.show("default")
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
