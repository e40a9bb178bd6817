"""What a new user's pass found the APIs took where they should refuse it, or refused
in other words than the docs give, each through a real ``headroom serve`` of the
embedded default model (whose chat template has no tool support): an earlier assistant
turn's ``tool_calls`` left out of the prompt unsaid (where ``tools`` and ``tool``
messages are refused); ``modalities`` and ``audio`` asking for audio answered in text;
Anthropic's string content (and system) of whitespace only taken where the same text block is
refused, and a refusal that named its place twice; fields inside ``messages`` given
``invalid_value`` where docs/api.md has ``missing_field`` or ``invalid_type``."""

from __future__ import annotations

import httpx
import pytest
from test_service_cases import assert_openai_error

pytestmark = pytest.mark.slow

QUESTION = {"role": "user", "content": "weather?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=120, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_earlier_tool_calls_are_refused_where_the_template_renders_none(real_server, stream):
    """The template would render the assistant turn without its calls: a 400 naming
    them, in each API's shape, as ``tools`` and a ``tool`` message are refused there."""
    called = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    r = _post(real_server, "/v1/chat/completions",
              json={"messages": [QUESTION, called], "max_tokens": 1, "stream": stream})
    error = assert_openai_error(r, 400, param="messages[1].tool_calls", code="invalid_value")
    assert "chat template has no tool support" in error["message"], error
    # Ollama checks no tool history: the calls are refused mid-conversation too.
    ollama_call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    called = {"role": "assistant", "content": "", "tool_calls": [ollama_call]}
    for turns in ([QUESTION, called], [QUESTION, called, {"role": "user", "content": "and?"}]):
        r = _post(real_server, "/api/chat", json={"model": "default", "messages": turns, "stream": stream,
                                                   "options": {"num_predict": 1}})
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert message.startswith("messages[1].tool_calls ") and "no tool support" in message, message


def test_a_tool_message_after_the_calls_is_still_named_and_no_calls_are_taken(real_server):
    called = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    answered = [QUESTION, called, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = _post(real_server, "/v1/chat/completions", json={"messages": answered, "max_tokens": 1})
    assert_openai_error(r, 400, param="messages[2].role", code="invalid_value")
    # An empty list of calls asks for nothing the template leaves out.
    said = [QUESTION, {"role": "assistant", "content": "Sunny.", "tool_calls": []}, {"role": "user", "content": "ok"}]
    r = _post(real_server, "/v1/chat/completions", json={"messages": said, "max_tokens": 1})
    assert r.status_code == 200, r.text
    # Anthropic's tool_use always needs its tool_result (or is a refused prefill): named as before.
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    turns = [QUESTION, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    r = _post(real_server, "/v1/messages", json={"model": "default", "max_tokens": 1, "messages": turns})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[2].content[0] is a tool_result block"), r.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"modalities": ["audio"]}, "modalities"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text"], "audio": {}}, "audio"),
    ],
)
def test_audio_output_is_refused_not_answered_in_text(real_server, extra, param):
    r = _post(real_server, "/v1/chat/completions", json={"messages": [QUESTION], "max_tokens": 1, **extra})
    error = assert_openai_error(r, 400, param=param, code="invalid_value")
    assert "text only" in error["message"], error


def test_text_modalities_are_served(real_server):
    for extra in ({"modalities": ["text"]}, {"modalities": None, "audio": None}):
        r = _post(real_server, "/v1/chat/completions", json={"messages": [QUESTION], "max_tokens": 1, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
    r = _post(real_server, "/v1/chat/completions", json={"messages": [QUESTION], "modalities": "text"})
    assert_openai_error(r, 400, param="modalities", code="invalid_type")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_takes_a_string_content_as_one_text_block(real_server, path):
    """Whitespace alone is refused in a string as in a text block, and each refusal
    names its place once."""
    body = {"model": "default", "max_tokens": 1}
    for content, where in (("   ", "messages[0].content"), ([{"type": "text", "text": " \n"}], "messages[0].content[0]")):
        r = _post(real_server, path, json={**body, "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{where}: text content blocks must contain non-whitespace text"), message
    turns = [QUESTION, {"role": "assistant", "content": " \t"}, QUESTION]
    r = _post(real_server, path, json={**body, "messages": turns})
    assert r.json()["error"]["message"].startswith("messages[1].content: text content blocks"), r.text
    for empty in ("", []):
        r = _post(real_server, path, json={**body, "messages": [{"role": "user", "content": empty}]})
        message = r.json()["error"]["message"]
        assert message.startswith("messages[0].content: all messages must have non-empty content"), message
        assert message.count("messages[0]") == 1, message
    # Text around its whitespace is text.
    r = _post(real_server, path, json={**body, "messages": [{"role": "user", "content": " hi "}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_takes_a_string_system_as_one_text_block(real_server, path):
    """A system string of whitespace only is refused as the same text in a system block
    is (Anthropic: ``system: text content blocks must contain non-whitespace text``),
    where it was served, the template's own system prompt replaced by the blanks."""
    body = {"model": "default", "max_tokens": 1, "messages": [QUESTION]}
    for system, where in ((" \n\t", "system"), ([{"type": "text", "text": " \n\t"}], "system[0]")):
        r = _post(real_server, path, json={**body, "system": system})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["message"].startswith(f"{where}: text content blocks must contain non-whitespace text"), error
    # No system (an empty string says none) and a system with text are served.
    for extra in ({}, {"system": ""}, {"system": " Be brief. "}):
        assert _post(real_server, path, json={**body, **extra}).status_code == 200, extra


CALLED = {"role": "assistant", "content": None}


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        ([{"role": "user", "content": 123}], "messages[0].content", "invalid_type"),
        ([{"role": "user", "content": None}], "messages[0].content", "invalid_type"),
        ([{"role": "user", "content": [{"type": "text", "text": 123}]}], "messages[0].content[0].text", "invalid_type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "missing_field"),
        ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]", "invalid_type"),
        ([{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0].type", "missing_field"),
        ([{"role": "user"}], "messages[0].content", "missing_field"),
        ([{"content": "hi"}], "messages[0].role", "missing_field"),
        ([{"role": 5, "content": "hi"}], "messages[0].role", "invalid_type"),
        ([QUESTION, {**CALLED, "tool_calls": "c1"}], "messages[1].tool_calls", "invalid_type"),
        ([QUESTION, {**CALLED, "tool_calls": [{"id": "c1"}]}], "messages[1].tool_calls[0].function", "missing_field"),
        ([QUESTION, {**CALLED, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": 5}}]}],
         "messages[1].tool_calls[0].function.arguments", "invalid_type"),
        ([QUESTION, {**CALLED, "tool_calls": []}], "messages[1].content", "invalid_type"),
        ([QUESTION, {**CALLED, "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}],
         "messages[2].tool_call_id", "missing_field"),
        ([QUESTION, {**CALLED, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": 5, "content": "sunny"}],
         "messages[2].tool_call_id", "invalid_type"),
        # Values, not types: as before.
        ([{"role": "nobody", "content": "hi"}], "messages[0].role", "invalid_value"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]", "invalid_value"),
        ([{"role": "user", "content": []}], "messages[0].content", "invalid_value"),
    ],
)
def test_nested_fields_have_the_documented_codes(real_server, messages, param, code):
    """docs/api.md's codes, as the top-level fields have them: ``missing_field`` for a
    field absent, ``invalid_type`` for one of the wrong JSON type, naming the field."""
    r = _post(real_server, "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    error = assert_openai_error(r, 400, param=param, code=code)
    assert error["message"].startswith(param), error
