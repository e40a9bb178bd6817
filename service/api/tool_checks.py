"""The checks of tools and of a conversation's tool history that the APIs share, each
rule in one place, each API's refusal in its own words:

- a tool's name (a tool's and a past call's): OpenAI takes ``^[a-zA-Z0-9_-]{1,64}$``,
  Anthropic ``^[a-zA-Z0-9_-]{1,128}$`` (:func:`check_tool_name`);
- a past call's ``arguments`` (OpenAI's): JSON text of an object (blank text is ``{}``),
  or the object itself (:func:`check_call_arguments`);
- the history (:func:`check_tool_history`): each assistant turn's calls are answered in
  the turn right after it (OpenAI: the tool messages that follow it; Anthropic: the
  next user message's ``tool_result`` blocks), each exactly once, a result answers a
  call of that turn only, and call ids are unique in the conversation. A last
  assistant turn (an answer's prefill) needs no answers;
- past calls on a model whose chat template has no tool support
  (:func:`check_calls_rendered`): refused, as ``tools`` and ``tool`` messages are there,
  rather than left out of the prompt.

Each refusal is a 400 naming the field or turn at fault
(:func:`service.common.errors.invalid`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.text.chat import ChatTemplateError
from service.api.openai.messages import json_type
from service.common.errors import INVALID_TYPE, APIError, invalid

# The longest tool name each API takes.
OPENAI_NAME_LENGTH = 64
ANTHROPIC_NAME_LENGTH = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]+")


def check_tool_name(name: Any, param: str, longest: int = OPENAI_NAME_LENGTH) -> None:
    """A function's name as the API takes it: ``^[a-zA-Z0-9_-]{1,longest}$`` (a name
    that is no string, or blank, is left to the tools' own checks, which say it needs
    a name).

    Raises:
        APIError: 400 ``param`` naming the tool.
    """
    if isinstance(name, str) and name.strip() and not (_NAME.fullmatch(name) and len(name) <= longest):
        raise invalid(
            f"tool name {name!r} is not allowed: a function's name must match ^[a-zA-Z0-9_-]{{1,{longest}}}$ "
            f"(letters, digits, underscores and hyphens, at most {longest}): rename the tool",
            param,
        )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_call_arguments(arguments: Any, param: str) -> None:
    """A past call's ``arguments``: text whose JSON is an object (blank text counts as
    ``{}``), or an object (taken as it is, and shown to the model as its JSON text).

    Raises:
        APIError: 400 ``param`` for another type (an array, a number, null...:
            ``invalid_type``), text that is not JSON (``NaN`` and ``Infinity`` are not) or JSON that is no object.
    """
    if isinstance(arguments, dict):
        return
    if not isinstance(arguments, str):
        kind = "null" if arguments is None else type(arguments).__name__
        raise invalid(
            f"{param} must be a string (the call's arguments as JSON object text, e.g. "
            f"'{{\"city\": \"Paris\"}}'), got {kind}",
            param,
            INVALID_TYPE,
        )
    if not arguments.strip():
        return
    try:
        value = json.loads(arguments, parse_constant=_no_constant)
    except RecursionError:  # nested past the reader's depth: left to the template, as sent
        return
    except ValueError as exc:
        raise invalid(
            f"{param} is not JSON ({exc}): send the call's arguments as JSON text, "
            "e.g. '{\"city\": \"Paris\"}', or as an object",
            param,
        ) from None
    if not isinstance(value, dict):
        raise invalid(
            f"{param} is JSON of {type(value).__name__ if value is not None else 'null'}, not an object: "
            "a call's arguments are an object of its parameters, e.g. '{\"city\": \"Paris\"}' ('{}' for none)",
            param,
        )


def check_calls_rendered(messages: Sequence[Any], has_tools: bool) -> None:
    """An assistant message's ``tool_calls`` where the chat template has no tool support
    (``has_tools`` false: :func:`engine.text.chat.template_has_tools`): such a template
    renders the turn without them, so the model would never see the call. Refused as
    ``tools`` and a ``tool`` message are there; checked once the template rendered
    ``messages`` (the chat messages the API made), so that a malformed message or a
    ``tool`` message after the call is named first, as the template names it.

    Raises:
        ChatTemplateError: ``messages[i].tool_calls`` (answered 400 in the API's terms).
    """
    if has_tools:
        return
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "assistant" and message.get("tool_calls"):
            param = f"messages[{i}].tool_calls"
            raise ChatTemplateError(
                f"{param} cannot be sent to this model: its chat template has no tool support (it renders "
                "no tool calls, so the call would be left out of the prompt); send the call as text in the "
                "message's content, or serve a model whose chat template renders tools",
                param,
            )


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation as :func:`check_tool_history` sees it.

    ``param``: the turn's path (``messages[i]``); ``calls``: ``(id, path)`` of each tool call the turn makes; ``answers``: ``(id,
    path)`` of each tool result it holds (an id that is no string: None)."""

    param: str
    calls: tuple[tuple[str | None, str], ...] = ()
    answers: tuple[tuple[str | None, str], ...] = ()


@dataclass(frozen=True)
class HistoryWords:
    """An API's words for the history's refusals: format strings of ``{ids}`` (the ids
    at fault, quoted, joined by commas) and ``{turn}`` (the turn that made the calls)."""

    unanswered: str
    stray: str
    twice: str
    duplicate: str


OPENAI_HISTORY = HistoryWords(
    unanswered="an assistant message with 'tool_calls' must be followed by tool messages responding to each "
    "'tool_call_id'; these tool_call_ids of {turn} have no response message: {ids}; send a tool message "
    "for each right after it, or leave the call out",
    stray="messages with role 'tool' must be a response to a preceding message with 'tool_calls': "
    "tool_call_id {ids} answers no call of the assistant message right before the tool messages; "
    "send each tool message right after the assistant message whose tool_calls hold its id",
    twice="tool_call_id {ids} is answered twice: send one tool message per call",
    duplicate="tool_call id {ids} is given twice: each call needs its own id",
)
ANTHROPIC_HISTORY = HistoryWords(
    unanswered="tool_use ids were found without tool_result blocks immediately after: {ids}. Each tool_use "
    "block must have a corresponding tool_result block in the next message: send the results "
    "in the user message right after it",
    stray="unexpected tool_use_id found in tool_result blocks: {ids}. Each tool_result block must have a "
    "corresponding tool_use block in the previous message: send the result in the user message right "
    "after its tool_use, or leave it out",
    twice="each tool_use must have a single result: found several tool_result blocks with id {ids}",
    duplicate="tool_use ids must be unique: {ids} is given twice",
)


def check_tool_history(turns: Sequence[Turn], words: HistoryWords) -> None:
    """The conversation's calls and results, by the rules of the module docstring.

    Raises:
        APIError: 400 naming the result at fault (answering no call of the turn before
            it, or a call answered already), the call whose id was given before, or
            the assistant turn whose calls the next turn leaves unanswered.
    """
    seen: set[str | None] = set()
    before: Turn | None = None
    for turn in turns:
        asked = [call_id for call_id, _ in before.calls] if before is not None else []
        answered: set[str | None] = set()
        for call_id, path in turn.answers:
            if call_id not in asked:
                raise invalid(words.stray.format(ids=repr(call_id)), path)
            if call_id in answered:
                raise invalid(words.twice.format(ids=repr(call_id)), path)
            answered.add(call_id)
        missing = [repr(call_id) for call_id in asked if call_id not in answered]
        if missing and before is not None:
            raise invalid(words.unanswered.format(ids=", ".join(missing), turn=before.param), before.param)
        for call_id, path in turn.calls:
            if call_id in seen:
                raise invalid(words.duplicate.format(ids=repr(call_id)), path)
            seen.add(call_id)
        before = turn


CHOICES = (
    "tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} or "
    "{'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto' | 'required', 'tools': [{'type': 'function', "
    "'function': {'name': ...}}]}}"
)
_FUNCTION_SHAPE = "expected {type: function, function: {name}}"


@dataclass(frozen=True)
class Choice:
    """What OpenAI's ``tool_choice`` asks of an answer with tools.

    ``mode``: ``none``, ``auto``, ``required`` (a call to one of ``allowed``) or
    ``function`` (a call to ``name``); ``allowed``: the names of the tools a forced
    call may take (None: all of them; ``allowed_tools``' list, whose ``mode`` must be
    ``required``)."""

    mode: str
    name: str | None = None
    allowed: tuple[str, ...] | None = None


def tool_choice_of(tool_choice: Any, names: Sequence[str]) -> Choice:
    """``tool_choice`` (None is ``auto``) checked against the tools' ``names``.

    Raises:
        APIError: 400 ``tool_choice`` saying what is wrong with the value sent: an
            unknown value or type (one that is neither a string nor an object:
            ``invalid_type``, :func:`unknown_choice`), a function object without ``function.name`` (a
            ``name`` beside ``type``, the Responses API's shape, named as such), a name
            (quoted) not among ``names``, an ``allowed_tools`` whose ``mode`` or
            ``tools`` is not OpenAI's, or one of mode ``auto`` (not supported: a call
            the model makes on its own could not be kept to the list).
    """
    if tool_choice is None:
        return Choice("auto")
    if tool_choice in ("none", "auto", "required"):
        return Choice(tool_choice)
    if not isinstance(tool_choice, dict):
        raise unknown_choice(tool_choice)
    kind = tool_choice.get("type")
    if kind == "function":
        return Choice("function", _function_name(tool_choice, "tool_choice", names))
    if kind != "allowed_tools":
        raise invalid(f"tool_choice type {kind!r} is not supported: {CHOICES}", "tool_choice")
    spec = tool_choice.get("allowed_tools")
    mode = spec.get("mode") if isinstance(spec, dict) else None
    tools = spec.get("tools") if isinstance(spec, dict) else None
    if mode not in ("auto", "required") or not isinstance(tools, list) or not tools:
        raise invalid(
            "tool_choice.allowed_tools must be {mode: 'auto' | 'required', tools: [{type: function, "
            "function: {name}}, ...]} with at least one tool",
            "tool_choice",
        )
    allowed = tuple(
        _function_name(tool, f"tool_choice.allowed_tools.tools[{k}]", names) for k, tool in enumerate(tools)
    )
    if mode == "auto":  # every tool is shown: only a forced call's grammar keeps the call to the list
        raise invalid(
            "tool_choice.allowed_tools with mode 'auto' is not supported by this server (a call the model "
            "makes on its own could not be kept to the listed tools): send mode 'required', or send only "
            "the allowed tools in tools with tool_choice 'auto'",
            "tool_choice",
        )
    return Choice(mode, allowed=allowed)


def unknown_choice(tool_choice: Any) -> APIError:
    """The refusal of a ``tool_choice`` that is no object and none of OpenAI's strings:
    ``invalid_value`` for another string, ``invalid_type`` for another JSON type
    (``5``, ``true``, a list), as docs/api.md's Errors give it."""
    if isinstance(tool_choice, str):
        return invalid(CHOICES, "tool_choice")
    return invalid(f"{CHOICES}, got {json_type(tool_choice)}", "tool_choice", INVALID_TYPE)


def _function_name(choice: Any, where: str, names: Sequence[str]) -> str:
    """The function a ``{type: function, function: {name}}`` object names, one of ``names``."""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        beside = " (a name beside type is the Responses API's shape)" if isinstance(choice, dict) and "name" in choice else ""
        raise invalid(f"{where}.function.name is missing: {_FUNCTION_SHAPE}{beside}", "tool_choice")
    if name not in names:
        raise invalid(f"{where} names the function {name!r}, which is not among tools ({', '.join(names)})", "tool_choice")
    return name
