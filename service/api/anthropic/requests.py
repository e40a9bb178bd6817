"""Anthropic's bodies as the one :class:`~service.api.request.GenerationRequest` a call
runs as, on the path of the other APIs.

The conversation becomes the chat messages the model's template renders: ``system``
(text or text blocks) a system message first; a user turn's ``tool_result`` blocks one
``tool`` message each (in their order, before the turn's text; ``is_error`` puts
``Error: `` before the result), its text blocks the user message; an assistant turn's
text its content, its ``tool_use`` blocks its tool calls and its ``thinking`` blocks its
``thinking`` (the template decides whether earlier reasoning is shown again, as
:mod:`engine.text.chat` says: gpt-oss's before a call not yet answered in words, as
Anthropic keeps a tool-use turn's thinking); consecutive turns of one role are one.
``tools`` become function tools (``input_schema`` their parameters) and ``tool_choice``
their choice (``auto``, ``any``: a call is required, ``tool``: that one, ``none``),
through the tools machinery of :mod:`service.api.tools`. ``thinking`` is the template's
``enable_thinking``: ``enabled``, ``adaptive`` and ``between_tools`` true, ``disabled``
and none false (no thinking unless asked, as Anthropic does); ``budget_tokens`` (at
least 1024, below ``max_tokens``, as Anthropic requires) becomes ``thinking_budget``.
``max_tokens`` larger than what the context leaves after the prompt is cut to it, as
Anthropic's recent models do (the answer then ends with
``model_context_window_exceeded``): Claude Code asks for more than a local model's
context holds. ``output_config.format`` is the answer's JSON schema.

Refused with a 400 rather than dropped: image and document blocks (this server serves
text models), Anthropic's server tools, ``thinking`` enabled beside a ``tool_choice``
that forces a call (``any``, ``tool``: as Anthropic refuses it), a last turn that is
the assistant's (an answer's prefill), blocks in a turn of the other role; and, as
Anthropic refuses them, a text block without non-whitespace text (a turn's content or
``system`` given as a string too: Anthropic takes it as one text block), a tool name outside
``^[a-zA-Z0-9_-]{1,128}$`` (a tool's or a past ``tool_use``'s) and a tool history
Anthropic refuses (:func:`service.api.tool_checks.check_tool_history`): each assistant
turn's ``tool_use`` blocks answered by ``tool_result`` blocks in the user message right
after it, each once, ``tool_use`` ids unique.
"""

from __future__ import annotations

import json
from typing import Any

from engine.text.chat import ChatTemplateError
from service.api.anthropic.schemas import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from service.api.prompts import Prompt, chat_prompt
from service.api.request import GenerationRequest, stop_strings
from service.api.sampling import Sampling
from service.api.structured import response_schema
from service.api.tool_checks import (
    ANTHROPIC_HISTORY,
    ANTHROPIC_NAME_LENGTH,
    Turn,
    check_tool_history,
    check_tool_name,
)
from service.common.errors import APIError, invalid

# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024
_NO_VISION = "this model has no vision: image blocks are not supported by this server"


def _block_text(block: TextBlock | str, param: str) -> str:
    """A text block's text (a turn's content given as a string is one text block, as
    Anthropic takes it); an empty one, or one of whitespace only, is refused, as
    Anthropic refuses it.

    Raises:
        APIError: 400 ``param`` (the block's path, or the content's) for a text block without text.
    """
    text = block if isinstance(block, str) else block.text
    if not text.strip():
        where = "content" if isinstance(block, str) else "block"
        raise invalid(f"{param}: text content blocks must contain non-whitespace text; put text in the "
                      f"{where} or leave it out", param)
    return text


def _text(blocks: str | list[Any], param: str) -> str:
    """Text, or text blocks joined by newlines; an empty text block or any other block is a 400."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(_block_text(block, f"{param}[{j}]"))
        elif isinstance(block, ImageBlock):
            raise invalid(_NO_VISION, f"{param}[{j}]")
        else:
            raise invalid(f"{param}[{j}]: only text blocks are supported here", f"{param}[{j}]")
    return "\n".join(texts)


def _user_turn(content: list[Any], i: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn's blocks as chat messages: its tool results, then its text."""
    out: list[dict[str, Any]] = []
    texts = []
    for j, block in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            result = _text(block.content, f"{param}.content")
            out.append({
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "name": names[block.tool_use_id],
                "content": "Error: " + result if block.is_error else result,
            })
        elif isinstance(block, TextBlock):
            texts.append(_block_text(block, param))
        elif isinstance(block, ImageBlock):
            raise invalid(_NO_VISION, param)
        elif isinstance(block, DocumentBlock):
            raise invalid("document blocks are not supported by this server", param)
        else:
            raise invalid(f"{param}: a {block.__struct_config__.tag} block belongs in an assistant turn", param)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(content: list[Any], i: int, names: dict[str, str]) -> dict[str, Any]:
    """An assistant turn's blocks as one message: text, tool calls and thinking."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(_block_text(block, f"messages[{i}].content[{j}]"))
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            check_tool_name(block.name, f"messages[{i}].content[{j}].name", ANTHROPIC_NAME_LENGTH)
            names[block.id] = block.name
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, (ImageBlock, DocumentBlock, ToolResultBlock)):
            param = f"messages[{i}].content[{j}]"
            raise invalid(f"{param}: a {block.__struct_config__.tag} block belongs in a user turn", param)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["thinking"] = "\n".join(thoughts)
    return message


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as the chat messages the template renders (module docstring).

    Raises:
        APIError: 400 naming the block or turn at fault.
    """
    out: list[dict[str, Any]] = []
    if body.system:  # a string is one text block: whitespace alone is refused ("" is no system)
        text = _block_text(body.system, "system") if isinstance(body.system, str) else _text(body.system, "system")
        out.append({"role": "system", "content": text})
    check_tool_history(_history(body), ANTHROPIC_HISTORY)
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for its result
    for i, turn in enumerate(body.messages):
        if not turn.content and not (turn.role == "assistant" and i == len(body.messages) - 1):
            # As Anthropic answers: only a last assistant turn (a prefill) may be empty.
            raise invalid(f"messages[{i}].content: all messages must have non-empty content except for the "
                          "optional final assistant message", f"messages[{i}].content")
        if isinstance(turn.content, str) and turn.content:
            _block_text(turn.content, f"messages[{i}].content")  # one text block: whitespace alone is refused
        if turn.role == "assistant":
            if isinstance(turn.content, str):
                out.append({"role": "assistant", "content": turn.content})
            else:
                out.append(_assistant_turn(turn.content, i, names))
        elif isinstance(turn.content, str):
            out.append({"role": "user", "content": turn.content})
        else:
            out += _user_turn(turn.content, i, names)
    return _joined(out)


def _history(body: CountTokensRequest) -> list[Turn]:
    """The turns' tool_use and tool_result blocks, consecutive turns of one role as one
    (as Anthropic combines them)."""
    turns: list[Turn] = []
    for i, message in enumerate(body.messages):
        blocks = list(enumerate(message.content)) if isinstance(message.content, list) else []
        calls = tuple((b.id, f"messages[{i}].content[{j}]") for j, b in blocks if isinstance(b, ToolUseBlock))
        answers = tuple(
            (b.tool_use_id, f"messages[{i}].content[{j}]") for j, b in blocks if isinstance(b, ToolResultBlock)
        )
        param = f"messages[{i}]"
        if i and message.role == body.messages[i - 1].role:
            last = turns.pop()
            param, calls, answers = last.param, last.calls + calls, last.answers + answers
        turns.append(Turn(param, calls, answers))
    return turns


def _joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) messages as one, their texts apart by a blank
    line, as Anthropic combines consecutive turns of a role (templates that require
    turns to alternate take them); an assistant message is not continued after its
    tool calls."""
    out: list[dict[str, Any]] = []
    for message in messages:
        last = out[-1] if out else None
        if (
            last is not None
            and last["role"] == message["role"] in ("user", "assistant")
            and not last.get("tool_calls")
        ):
            last["content"] = "\n\n".join(t for t in (last["content"], message["content"]) if t)
            for key in ("tool_calls", "thinking"):
                if message.get(key):
                    last[key] = message[key]
            continue
        out.append(message)
    return out


def _tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """``tools`` as function tools.

    Raises:
        APIError: 400 ``tools[i]`` for a server tool or a tool without ``input_schema``;
            400 ``tools[i].name`` for a name outside ``^[a-zA-Z0-9_-]{1,128}$``.
    """
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise invalid(
                f"tools[{i}]: server tools ({tool.type}) are not supported by this server; "
                "send client tools with an input_schema",
                f"tools[{i}]",
            )
        if tool.input_schema is None:
            raise invalid(f"tools[{i}].input_schema is required", f"tools[{i}].input_schema")
        check_tool_name(tool.name, f"tools[{i}].name", ANTHROPIC_NAME_LENGTH)
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: CountTokensRequest) -> Any:
    """``tool_choice`` as the tools machinery takes it (OpenAI's values)."""
    choice = body.tool_choice
    if choice is None or isinstance(choice, ToolChoiceAuto):
        return None if choice is None else "auto"
    if isinstance(choice, ToolChoiceNone):
        return "none"
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return {"type": "function", "function": {"name": choice.name}}


def _prompt(body: CountTokensRequest, tools: list[dict[str, Any]] | None) -> Prompt:
    thinking = body.thinking is not None and not isinstance(body.thinking, ThinkingDisabled)
    if body.messages[-1].role == "assistant":
        raise invalid(
            "the last turn is the assistant's: continuing (prefilling) an answer is not "
            "supported by this server; end with a user turn",
            f"messages[{len(body.messages) - 1}]",
        )
    (prompt,) = chat_prompt(chat_messages(body), tools, {"enable_thinking": thinking})
    return prompt


def _check_forced_tool(body: CountTokensRequest) -> None:
    """Thinking enabled beside a forced tool call (``tool_choice`` ``any`` or ``tool``)
    is refused, as Anthropic refuses it on ``/v1/messages`` and its ``count_tokens``.

    Raises:
        APIError: 400 ``tool_choice``.
    """
    if isinstance(body.thinking, ThinkingEnabled) and isinstance(body.tool_choice, (ToolChoiceAny, ToolChoiceTool)):
        raise invalid("Thinking may not be enabled when tool_choice forces tool use.", "tool_choice")


def _thinking_budget(body: MessagesRequest) -> int | None:
    """``thinking.budget_tokens``, checked as Anthropic checks it (thinking beside a
    forced tool call refused first: :func:`_check_forced_tool`)."""
    _check_forced_tool(body)
    if not isinstance(body.thinking, ThinkingEnabled):
        return None
    budget = body.thinking.budget_tokens
    if budget < MIN_THINKING_BUDGET or budget >= body.max_tokens:
        raise invalid(
            f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than "
            f"max_tokens ({body.max_tokens}), got {budget}",
            "thinking.budget_tokens",
        )
    return budget


def _output_schema(body: MessagesRequest) -> str | None:
    """``output_config.format``'s schema as JSON text, or None; a boolean schema as
    the OpenAI routes take it (:func:`service.api.structured.response_schema`: ``true``
    any JSON value, ``false`` a 400)."""
    config = body.output_config
    if config is None or config.format is None:
        return None
    return response_schema({"type": config.format.type, "schema": config.format.schema}, "output_config.format")


def messages_request(body: MessagesRequest, request_id: str, started: float) -> GenerationRequest:
    """``/v1/messages``'s body as the request it runs as.

    Raises:
        APIError: 400 naming the field (``stop_sequences``, ``tools[i]``,
            ``thinking.budget_tokens``, ``tool_choice`` forcing a call beside enabled
            thinking, a block of ``messages``...).
    """
    budget = _thinking_budget(body)
    stop = stop_strings(body.stop_sequences, "stop_sequences")
    tools = _tools(body)
    return GenerationRequest(
        request_id=request_id,
        started=started,
        prompts=(_prompt(body, tools),),
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        # Up to max_tokens, as much as the context leaves (stop reason
        # model_context_window_exceeded when that was less).
        default_max_tokens=body.max_tokens,
        stop=tuple(stop),
        chat=True,
        tools=tools,
        tool_choice=_tool_choice(body),
        json_schema=_output_schema(body),
        schema_param="output_config.format",
        stream=body.stream,
        # enabled: think (within the budget); disabled or absent: no thinking, a block the
        # model opens anyway closed at once; adaptive: as the template decides.
        thinking=(True if isinstance(body.thinking, ThinkingEnabled)
                  else False if body.thinking is None or isinstance(body.thinking, ThinkingDisabled) else None),
        thinking_budget=budget,
        thinking_param="thinking",
    )


def count_request(body: CountTokensRequest, request_id: str, started: float) -> GenerationRequest:
    """``/v1/messages/count_tokens``'s body as a request whose prompt is counted (never
    run).

    Raises:
        APIError: 400 naming the field, as :func:`messages_request` (thinking beside a
            forced tool call included).
    """
    _check_forced_tool(body)
    tools = _tools(body)
    return GenerationRequest(
        request_id=request_id,
        started=started,
        prompts=(_prompt(body, tools),),
        sampling=Sampling(),
        chat=True,
        tools=tools,
        tool_choice=_tool_choice(body),
    )


def thinking_asked(body: CountTokensRequest) -> bool:
    """Whether the body asks for thinking as a must (``enabled``): a model whose template
    cannot think answers it 400 (``adaptive`` leaves it to the model)."""
    return isinstance(body.thinking, ThinkingEnabled)


def template_error(error: ChatTemplateError, body: CountTokensRequest) -> APIError:
    """A chat template's refusal (:class:`engine.text.chat.ChatTemplateError`) in the
    Messages body's terms: a ``tool`` message the template cannot render is the body's
    first ``tool_result`` block (tool results become the chat's tool messages in their
    order, and the template stops at the first), named with its path and the fix; any
    other refusal as it is."""
    if error.param.endswith(".role") and "'tool'" in error.message:
        for i, message in enumerate(body.messages):
            blocks = message.content if isinstance(message.content, list) else []
            for j, block in enumerate(blocks):
                if isinstance(block, ToolResultBlock):
                    path = f"messages[{i}].content[{j}]"
                    return invalid(
                        f"{path} is a tool_result block, which this model cannot take: its chat template has "
                        "no tool support (it renders no tool results); send text blocks only, or serve a "
                        "model whose chat template renders tools", path)
    return invalid(error.message, error.param)

