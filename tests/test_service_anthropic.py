"""Anthropic's Messages API of a real ``headroom serve``, through the official
``anthropic`` client: the embedded model with a chat template that has tools and
thinking (the Qwen-like one of test_service_tools.py), behind ``--api-key``.

One server for the module: messages (text, usage, stop reasons), streams (the events in
order, the text the whole answer's), tools (a forced call's ``tool_use`` block and the
turn after it with its ``tool_result``), thinking blocks, ``count_tokens``, ``x-api-key``
and the bearer form, and errors in Anthropic's shape, each as the client raises it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import anthropic
import httpx
import jsonschema_rs
import openai
import pytest
from service_harness import ServerProcess, serving
from test_api_tools import WEATHER
from thinking_server import THINKING_TEMPLATE

pytestmark = pytest.mark.slow

KEY = "sk-anthropic-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The newest client takes no temperature argument; the field is still Anthropic's.
GREEDY = {"model": "default", "max_tokens": 16, "extra_body": {"temperature": 0}}
BODY = {"model": "default", "max_tokens": 16, "temperature": 0, "messages": QUESTION}
TOOL = {"name": WEATHER["function"]["name"], "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template", "added_tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    """The embedded model with :data:`THINKING_TEMPLATE` (a copy of its folder: the
    weights linked, the tokenizer saved with that template), behind :data:`KEY`, with 48
    KV pages (a context of about 750 tokens, cheap to fill)."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("smollm-tools")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(default_model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    for entry in Path(default_model_dir).iterdir():
        if not entry.name.startswith(_TOKENIZER_FILES) and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)
    yield from serving(ServerProcess(tmp_path_factory.mktemp("anthropic"),
                                     ["--model", str(folder), "--num-pages", "48", "--api-key", KEY]))


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, timeout=300, max_retries=0)


def _raw(server: ServerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **kwargs.pop("headers", {})}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=300, **kwargs)


def _error(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic-shaped error answer of ``status`` and ``kind``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_message_text_usage_and_stop_reasons(client):
    message = client.messages.create(messages=QUESTION, **GREEDY)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 16
    short = client.messages.create(messages=QUESTION, **{**GREEDY, "max_tokens": 2})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    # A stop sequence from inside the greedy answer ends it there, and is named.
    text = message.content[0].text
    stop = text.split()[1] if len(text.split()) > 1 else text.split()[0]
    stopped = client.messages.create(messages=QUESTION, stop_sequences=[stop], **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    # max_tokens 0 is a 400 naming it, as Anthropic answers (it was an empty 200).
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=QUESTION, **{**GREEDY, "max_tokens": 0})
    assert exc.value.body["error"]["type"] == "invalid_request_error", exc.value.body
    assert "max_tokens: Expected `int` >= 1" in exc.value.body["error"]["message"], exc.value.body
    # output_config.format constrains the answer to a schema.
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    shaped = client.messages.create(
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **{**GREEDY, "max_tokens": 48},
    )
    jsonschema_rs.validate(schema, json.loads(shaped.content[0].text))
    # A system prompt reaches the template: more prompt tokens.
    # (cache_control, metadata and the beta header are accepted, and change nothing.)
    system = client.messages.create(
        messages=QUESTION,
        system=[{"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "u-1"},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
        **GREEDY,
    )
    assert system.usage.input_tokens > message.usage.input_tokens


def test_stream_events_in_order_and_the_whole_answer(client, server):
    whole = client.messages.create(messages=QUESTION, **GREEDY)
    with client.messages.stream(messages=QUESTION, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    # The events on the wire, ping included (the client drops it).
    with httpx.stream(
        "POST", server.base_url + "/v1/messages", json={**BODY, "stream": True}, headers={"x-api-key": KEY}, timeout=300
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["stop_reason"] is None
    assert datas[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert datas[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_forced_tool_use_and_the_turn_after(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}
    message = client.messages.create(messages=asked, **forced, **{**GREEDY, "max_tokens": 48})
    assert message.stop_reason == "tool_use", message
    call = message.content[-1]
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema_rs.validate(TOOL["input_schema"], call.input)
    with client.messages.stream(messages=asked, **forced, **{**GREEDY, "max_tokens": 48}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == call.input
    # "any" requires a call of some tool.
    anyone = client.messages.create(
        messages=asked, tools=[TOOL], tool_choice={"type": "any"}, **{**GREEDY, "max_tokens": 48}
    )
    assert anyone.stop_reason == "tool_use" and anyone.content[-1].name == "get_weather"
    # The call and its result go back to the model, rendered by the template.
    history = [
        *asked,
        {"role": "assistant", "content": [c.model_dump() for c in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                {"type": "text", "text": "Thanks. Anything else?"},
            ],
        },
    ]
    after = client.messages.create(messages=history, tools=[TOOL], **GREEDY)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    before = client.messages.count_tokens(model="default", messages=asked, tools=[TOOL])
    assert after.usage.input_tokens > before.input_tokens


def test_max_tokens_beyond_the_context_is_cut_to_it(client, server):
    models = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    context = models["data"][0]["context_length"]

    def hi(n: int) -> list[dict]:
        return [{"role": "user", "content": "Hi " * n}]

    def count(n: int) -> int:
        return client.messages.count_tokens(model="default", messages=hi(n)).input_tokens

    one, per = count(1), (count(101) - count(1)) / 100
    n = 1 + int((context - 4 - one) / per)
    left = context - count(n)
    assert 0 < left < 16, left
    # Claude Code asks for far more than a local context holds: the answer runs to the
    # end of the context instead of a 400.
    message = client.messages.create(messages=hi(n), **{**GREEDY, "max_tokens": 32000})
    assert message.stop_reason in ("model_context_window_exceeded", "end_turn"), message
    if message.stop_reason == "model_context_window_exceeded":
        assert message.usage.output_tokens == left


def test_count_tokens_is_the_prompt_of_a_message(client):
    for extra in ({}, {"system": "Be brief."}, {"tools": [TOOL]}):
        counted = client.messages.count_tokens(model="default", messages=QUESTION, **extra)
        message = client.messages.create(messages=QUESTION, **extra, **{**GREEDY, "max_tokens": 1})
        assert counted.input_tokens == message.usage.input_tokens > 0
    # Consecutive turns of a role are one turn, as Anthropic combines them.
    two = [{"role": "user", "content": "Hi."}, {"role": "user", "content": [{"type": "text", "text": "Bye."}]}]
    one = [{"role": "user", "content": "Hi.\n\nBye."}]
    assert (
        client.messages.count_tokens(model="default", messages=two).input_tokens
        == client.messages.count_tokens(model="default", messages=one).input_tokens
    )


def test_thinking_blocks(client):
    budget = {"type": "enabled", "budget_tokens": 1024}
    # The template opens a thinking block: the answer's first words are thinking.
    message = client.messages.create(
        messages=QUESTION, thinking=budget, **{**GREEDY, "max_tokens": 1100, "stop_sequences": ["."]}
    )
    assert message.content[0].type == "thinking" and message.content[0].thinking
    assert message.content[0].signature == ""
    with client.messages.stream(
        messages=QUESTION, thinking=budget, **{**GREEDY, "max_tokens": 1100, "stop_sequences": ["."]}
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking.strip() == message.content[0].thinking
    off = client.messages.create(messages=QUESTION, thinking={"type": "disabled"}, **GREEDY)
    assert all(b.type == "text" for b in off.content)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 1024}, **GREEDY)
    assert "budget_tokens" in exc.value.body["error"]["message"]


def test_keys_and_error_shapes(client, server):
    # The key as a bearer token works too; a wrong one is refused in Anthropic's shape.
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=KEY, max_retries=0, timeout=300)
    assert bearer.messages.count_tokens(model="default", messages=QUESTION).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(messages=QUESTION, **GREEDY)
    assert exc.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(messages=QUESTION, **{**GREEDY, "model": "claude-nope"})
    assert exc.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=[{"role": "user", "content": [image]}], **GREEDY)
    assert "vision" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=[{"role": "user", "content": "Hi " * 20000}], **GREEDY)
    assert exc.value.body["error"]["message"].startswith("prompt is too long")
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=QUESTION, tools=[{"type": "web_search_20250305", "name": "web_search"}], **GREEDY)
    assert "server tools" in exc.value.body["error"]["message"]
    # A schema the grammar cannot use names the field Anthropic's clients send.
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=QUESTION, output_config={"format": {"type": "json_schema",
                                                                            "schema": {"type": "nonsense"}}}, **GREEDY)
    assert exc.value.body["error"]["message"].startswith("output_config.format"), exc.value.body
    assert "response_format" not in exc.value.body["error"]["message"]
    # An empty turn is refused as Anthropic refuses it.
    for empty in ([], ""):
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.create(messages=[{"role": "user", "content": empty}], **GREEDY)
        assert "non-empty content" in exc.value.body["error"]["message"], exc.value.body
    # So is an empty text block, named by its place, in a turn of either role or the system.
    blank = [{"type": "text", "text": ""}]
    for messages, system, path in (
        ([{"role": "user", "content": blank}], None, "messages[0].content[0]"),
        ([*QUESTION, {"role": "assistant", "content": [{"type": "text", "text": "Hm."}, *blank]}, *QUESTION],
         None, "messages[1].content[1]"),
        (QUESTION, blank, "system[0]"),
    ):
        extra = {} if system is None else {"system": system}
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.create(messages=messages, **extra, **GREEDY)
        assert exc.value.body["error"]["type"] == "invalid_request_error", exc.value.body
        assert exc.value.body["error"]["message"].startswith(
            f"{path}: text content blocks must contain non-whitespace text"), exc.value.body
    # What the client cannot send: bad JSON, a missing field, a wrong type, other methods
    # and paths, all in Anthropic's shape.
    _error(_raw(server, "POST", "/v1/messages", content=b"{not json"), 400, "invalid_request_error")
    missing = _raw(server, "POST", "/v1/messages", json={"model": "default", "messages": QUESTION})
    assert "max_tokens" in _error(missing, 400, "invalid_request_error")
    typed = _raw(server, "POST", "/v1/messages", json={**BODY, "messages": "Hi"})
    assert "messages" in _error(typed, 400, "invalid_request_error")
    for field, value in (("system", [{"text": "Hi"}]), ("metadata", {"user_id": 5})):  # both were once served
        assert field in _error(_raw(server, "POST", "/v1/messages", json={**BODY, field: value}), 400, "invalid_request_error")
    _error(_raw(server, "GET", "/v1/messages"), 405, "invalid_request_error")
    _error(_raw(server, "POST", "/v1/messages/nope", json={}), 404, "not_found_error")
    _error(_raw(server, "POST", "/v1/messages", json=BODY, headers={"x-api-key": "x"}), 401, "authentication_error")
    _error(_raw(server, "POST", "/v1/messages", json=BODY, headers={"Host": "evil.example"}), 403, "permission_error")


def _use(call_id: str, name: str = "get_weather") -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": {"city": "Paris"}}


def _result(call_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "21 C"}


def test_tool_history_and_names_as_anthropic_checks_them(server):
    """Each assistant turn's tool_use ids are answered in the user message right after
    it, each once, ids unique; tool names match ^[a-zA-Z0-9_-]{1,128}$: else a 400 in
    Anthropic's shape naming the block, on messages and count_tokens alike."""
    user = {"role": "user", "content": "Weather in Paris?"}

    def asked(*blocks_of_turns) -> list[dict]:
        turns = [user]
        for k, blocks in enumerate(blocks_of_turns):
            turns.append({"role": "assistant" if k % 2 == 0 else "user", "content": list(blocks)})
        return turns

    then = {"type": "text", "text": "And in Rome?"}
    fine = asked([_use("toolu_1"), _use("toolu_2")], [_result("toolu_2"), _result("toolu_1")],
                 [_use("toolu_3")], [_result("toolu_3"), then])
    refused = (
        ([{"role": "user", "content": [_result("toolu_2")]}], "messages[0].content[0]",
         "unexpected tool_use_id found in tool_result blocks: 'toolu_2'"),
        (asked([_use("toolu_1")], [_result("toolu_2")]), "messages[2].content[0]",
         "unexpected tool_use_id found in tool_result blocks: 'toolu_2'"),
        (asked([_use("toolu_1")], [then]), "messages[1]",
         "tool_use ids were found without tool_result blocks immediately after: 'toolu_1'"),
        (asked([_use("toolu_1"), _use("toolu_2")], [_result("toolu_1")]), "messages[1]",
         "tool_use ids were found without tool_result blocks immediately after: 'toolu_2'"),
        (asked([_use("toolu_1")], [_result("toolu_1")], [_use("toolu_1")], [_result("toolu_1")]),
         "messages[3].content[0]", "tool_use ids must be unique: 'toolu_1'"),
        (asked([_use("toolu_1")], [_result("toolu_1"), _result("toolu_1")]), "messages[2].content[1]",
         "each tool_use must have a single result"),
        # The result two turns after its tool_use: the turn between leaves the call unanswered.
        (asked([_use("toolu_1")], [then], [{"type": "text", "text": "Hm."}], [_result("toolu_1")]),
         "messages[1]", "tool_use ids were found without tool_result blocks immediately after: 'toolu_1'"),
        (asked([_use("toolu_1", "get weather")], [_result("toolu_1")]), "messages[1].content[0].name",
         "tool name 'get weather' is not allowed"),
    )
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert _raw(server, "POST", path, json={**BODY, "messages": fine, "tools": [TOOL]}).status_code == 200
        for messages, at, said in refused:
            message = _error(_raw(server, "POST", path, json={**BODY, "messages": messages, "tools": [TOOL]}),
                             400, "invalid_request_error")
            assert message.startswith(f"{at}: {said}"), message
        for name, ok in (("x" * 128, True), ("x" * 129, False), ("get.weather", False), ("get-Weather_2", True)):
            answer = _raw(server, "POST", path, json={**BODY, "tools": [{**TOOL, "name": name}]})
            if ok:
                assert answer.status_code == 200, answer.text
            else:
                message = _error(answer, 400, "invalid_request_error")
                assert message.startswith(f"tools[0].name: tool name {name!r} is not allowed"), message
                assert "^[a-zA-Z0-9_-]{1,128}$" in message, message
    # A text block of whitespace only is refused; JSON Schema's true takes any value, as on OpenAI's routes.
    blank = _raw(server, "POST", "/v1/messages", json={**BODY, "messages": [
        {"role": "user", "content": [{"type": "text", "text": " \n\t"}]}]})
    assert _error(blank, 400, "invalid_request_error").startswith(
        "messages[0].content[0]: text content blocks must contain non-whitespace text")
    schema = {"type": "json_schema", "schema": True}
    anything = _raw(server, "POST", "/v1/messages", json={**BODY, "output_config": {"format": schema}})
    assert anything.status_code == 200 and anything.json()["content"], anything.text
    never = _raw(server, "POST", "/v1/messages", json={**BODY, "output_config": {"format": {**schema, "schema": False}}})
    assert "schema is false, which no value matches" in _error(never, 400, "invalid_request_error")


def test_thinking_asked_of_a_model_that_cannot_think(real_server):
    client = anthropic.Anthropic(base_url=real_server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 1024}, **{**GREEDY, "max_tokens": 2048}
        )
    assert "cannot think" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="cannot think"):  # counting it is refused alike
        client.messages.count_tokens(model="default", messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 1024})
    # "adaptive" leaves it to the model: no thinking here, and no error.
    adaptive = client.messages.create(messages=QUESTION, thinking={"type": "adaptive"}, **{**GREEDY, "max_tokens": 1})
    assert [b.type for b in adaptive.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=QUESTION, tools=[TOOL], **GREEDY)
    assert "no tool support" in exc.value.body["error"]["message"]
    # A tool result is named as the block the user sent, not the chat message it becomes.
    looked = [{"type": "text", "text": "Let me look."},
              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]
    answered = [*QUESTION, {"role": "assistant", "content": looked},
                {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]}]
    for call in (lambda: client.messages.create(messages=answered, **{**GREEDY, "max_tokens": 4}),
                 lambda: client.messages.count_tokens(model="default", messages=answered)):
        with pytest.raises(anthropic.BadRequestError) as exc:
            call()
        message = exc.value.body["error"]["message"]
        assert message.startswith("messages[2].content[1] is a tool_result block, which this model cannot take"), message
        assert "'tool'" not in message


def test_an_error_mid_stream_is_an_error_event(start_server):
    # The fake engine, slow enough that the worker dies under the stream.
    server = start_server(["--api-key", KEY], {"HEADROOM_FAKE_STEP_S": "0.2"}, fake=True)
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    texts = []
    with pytest.raises(anthropic.APIStatusError) as exc:  # noqa: PT012 - the kill is mid-stream
        with client.messages.stream(messages=QUESTION, **{**GREEDY, "max_tokens": 500}) as stream:
            for text in stream.text_stream:
                if not texts:
                    os.kill(server.worker_pid(), signal.SIGKILL)
                texts.append(text)
    assert texts and exc.value.body["type"] == "error"
    assert exc.value.body["error"]["type"] == "overloaded_error", exc.value.body


def test_models_in_anthropic_shape_with_x_api_key(client, server):
    """Anthropic's client lists and retrieves models in Anthropic's shape, its key sent as
    x-api-key; OpenAI's client on the same paths keeps OpenAI's shape."""
    page = client.models.list()
    ids = [m.id for m in page.data]
    assert "default" in ids and page.has_more is False
    assert page.first_id == ids[0] and page.last_id == ids[-1]
    for model in page.data:
        assert model.type == "model" and model.display_name and model.created_at.tzinfo is not None
    one = client.models.retrieve("default")
    assert one.id == "default" and one.type == "model" and one.display_name == page.data[0].display_name
    first = client.models.list(limit=1)
    assert [m.id for m in first.data] == ids[:1] and first.has_more == (len(ids) > 1)
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.models.retrieve("claude-nope")
    assert exc.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.models.list()
    assert "x-api-key" in exc.value.body["error"]["message"]
    _error(_raw(server, "GET", "/v1/models", params={"limit": 0}), 400, "invalid_request_error")
    both = {"after_id": "default", "before_id": "default"}  # was an empty page claiming more
    assert "not both" in _error(_raw(server, "GET", "/v1/models", params=both), 400, "invalid_request_error")
    openai_client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    listed = openai_client.models.list()
    assert [m.id for m in listed.data] == ids and listed.data[0].object == "model"
    # A message names the model the request named, as Anthropic echoes it, streamed or
    # not; OpenAI's chat answers with the served model's name, as OpenAI names the model
    # that answered.
    for name in ids:
        ask = {**GREEDY, "model": name, "max_tokens": 1}
        assert client.messages.create(messages=QUESTION, **ask).model == name
        with client.messages.stream(messages=QUESTION, **ask) as stream:
            assert stream.get_final_message().model == name
        chat = openai_client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)
        assert chat.model == ids[0]
    # x-api-key alone (no anthropic-version) is the key too, in OpenAI's shape.
    plain = httpx.get(server.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=60)
    assert plain.status_code == 200 and plain.json()["object"] == "list"
