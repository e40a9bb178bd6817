"""Reasoning settings each API refuses or accepts, without a server: a thinking budget
of 0 (no thinking), an effort and a budget that contradict each other, and Anthropic's
thinking beside a forced tool call (on /v1/messages and its count_tokens)."""

from __future__ import annotations

import msgspec
import pytest

from service.api.anthropic.errors import anthropic_error
from service.api.anthropic.requests import count_request, messages_request
from service.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from service.api.openai.requests import chat_request
from service.api.openai.schemas import ChatCompletionRequest
from service.api.thinking import check_thinking
from service.common.errors import APIError

HI = [{"role": "user", "content": "Hi"}]
NO_THINKING = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _chat(**body) -> object:
    decoded = msgspec.convert({"messages": HI, **body}, ChatCompletionRequest)
    return chat_request(decoded, "chatcmpl-x", 0.0, 0)


def test_a_budget_of_zero_is_no_thinking_and_asks_nothing_of_the_model():
    call = _chat(thinking_budget=0)
    assert (call.thinking, call.thinking_budget) == (False, 0)
    assert call.prompts[0].template_kwargs == {"enable_thinking": False}
    # A model that cannot think takes it, as it takes thinking off.
    check_thinking(call.thinking, call.thinking_budget, NO_THINKING, "m", call.thinking_param)
    check_thinking(None, 0, NO_THINKING, "m", "thinking_budget")
    with pytest.raises(APIError) as exc:
        check_thinking(None, 1, NO_THINKING, "m", "thinking_budget")
    assert exc.value.param == "thinking_budget"
    # With an effort that turns thinking off, 0 agrees with it.
    for effort in ("none", "minimal"):
        call = _chat(reasoning_effort=effort, thinking_budget=0)
        assert call.thinking is False and call.thinking_budget == 0


@pytest.mark.parametrize(
    ("effort", "budget"), [("none", 100), ("minimal", 1), ("low", 0), ("medium", 0), ("high", 0)]
)
def test_an_effort_and_a_budget_that_contradict_are_one_400_naming_both(effort, budget):
    with pytest.raises(APIError) as exc:
        _chat(reasoning_effort=effort, thinking_budget=budget)
    assert exc.value.status == 400 and exc.value.param == "thinking_budget"
    assert "reasoning_effort" in exc.value.message and "thinking_budget" in exc.value.message


def test_a_budget_with_an_effort_that_thinks_sets_that_effort_s_budget():
    call = _chat(reasoning_effort="low", thinking_budget=300)
    assert (call.thinking, call.thinking_budget) == (True, 300)
    assert call.thinking_param == "reasoning_effort"
    call = _chat(thinking_budget=300)
    assert (call.thinking, call.thinking_budget) == (None, 300)


def _messages(**body) -> object:
    decoded = msgspec.convert(
        {"model": "m", "max_tokens": 4096, "messages": HI, "tools": [{"name": "f", "input_schema": {"type": "object"}}], **body},
        MessagesRequest,
    )
    return messages_request(decoded, "msg_x", 0.0)


def _count(**body) -> object:
    """``/v1/messages/count_tokens``'s reading of the body :func:`_messages` reads."""
    decoded = msgspec.convert(
        {"model": "m", "messages": HI, "tools": [{"name": "f", "input_schema": {"type": "object"}}], **body},
        CountTokensRequest,
    )
    return count_request(decoded, "msg_x", 0.0)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "f"}])
@pytest.mark.parametrize("read", [_messages, _count], ids=["messages", "count_tokens"])
def test_anthropic_refuses_thinking_with_a_forced_tool_call(choice, read):
    with pytest.raises(APIError) as exc:
        read(thinking={"type": "enabled", "budget_tokens": 1024}, tool_choice=choice)
    status, body = anthropic_error(exc.value.status, exc.value.message, exc.value.code, exc.value.param)
    assert status == 400 and body.error.type == "invalid_request_error"
    assert body.error.message == "Thinking may not be enabled when tool_choice forces tool use."


def test_anthropic_takes_thinking_with_a_free_tool_choice_and_a_forced_call_without_thinking():
    for choice in ({"type": "auto"}, {"type": "none"}, None):
        extra = {} if choice is None else {"tool_choice": choice}
        call = _messages(thinking={"type": "enabled", "budget_tokens": 1024}, **extra)
        assert call.thinking is True
    for thinking in ({"type": "disabled"}, None):
        extra = {} if thinking is None else {"thinking": thinking}
        call = _messages(tool_choice={"type": "any"}, **extra)
        assert call.tool_choice == "required" and call.thinking is False
        assert _count(tool_choice={"type": "any"}, **extra).tool_choice == "required"
