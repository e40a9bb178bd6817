"""Reasoning settings each API refuses or accepts, without a server: a thinking budget
of 0 (no thinking), an effort and a budget that contradict each other."""

from __future__ import annotations

import msgspec
import pytest

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
