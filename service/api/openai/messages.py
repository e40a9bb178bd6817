"""The JSON shape of a chat completion's ``messages``, checked with the codes the
top-level fields get from the decoder (docs/api.md, Errors): a required field absent is
``missing_field``, one of the wrong JSON type ``invalid_type``, each naming the nested
field (``messages[0].content``, ``messages[0].content[1].text``).

``messages`` is decoded as a list of objects (:mod:`service.api.openai.schemas`) so that
the chat template takes each message as the client sent it; the values (a role the
template does not take, a content part of another type) stay the template's to refuse
(:mod:`engine.text.chat`, ``invalid_value``). Checked here: each message's ``role`` (a
string), ``content`` (a string or an array of content parts, required but on an
assistant message that calls tools; an empty array is ``invalid_value``, as OpenAI
refuses it: :func:`check_content`), each part's ``type`` and a text part's ``text``
(strings), an assistant message's ``tool_calls`` (an array of objects, each with a
``function`` object whose ``name`` is a string) and a tool message's ``tool_call_id``
(a string). :func:`field_of` reads one field by
that rule, for the Responses API's items too (:mod:`service.api.openai.responses_items`).
"""

from __future__ import annotations

from typing import Any

from service.common.errors import INVALID_TYPE, MISSING_FIELD, invalid


def json_type(value: Any) -> str:
    """``value``'s JSON type, as a client names it (``number``, not ``int``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def field_of(parent: dict[str, Any], key: str, param: str, kind: Any, expected: str, hint: str) -> Any:
    """``parent[key]``, present and an instance of ``kind`` (a type or a union of them);
    ``expected`` names the type in words, ``hint`` says what to send.

    Raises:
        APIError: 400 ``missing_field`` or ``invalid_type`` naming ``param``.
    """
    if key not in parent:
        raise invalid(f"{param} is missing: {hint}", param, MISSING_FIELD)
    value = parent[key]
    if not isinstance(value, kind):
        raise invalid(f"{param} must be {expected}, got {json_type(value)}: {hint}", param, INVALID_TYPE)
    return value


_TEXT_PART = '{"type": "text", "text": "..."}'
_ANSWER = ('a tool message is {"role": "tool", "tool_call_id": ..., "content": ...}, tool_call_id the id '
           "of the call it answers")
_CALL = 'a tool call is {"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}'


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Each message's fields of the module docstring, in order.

    Raises:
        APIError: 400 ``missing_field`` or ``invalid_type`` naming the field.
    """
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = field_of(message, "role", f"{where}.role", str, "a string",
                        'each message needs its role ("system", "user", "assistant"...)')
        if role == "tool":  # the call it answers (tool_checks' history rule checks that call)
            field_of(message, "tool_call_id", f"{where}.tool_call_id", str, "a string", _ANSWER)
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            _check_calls(calls, f"{where}.tool_calls")
        if calls and message.get("content") is None:
            continue  # an assistant turn that only called tools
        content = field_of(message, "content", f"{where}.content", str | list, "a string or an array of content parts",
                           f"send the message's text as a string, or as [{_TEXT_PART}]")
        if isinstance(content, list):
            check_content(content, f"{where}.content")
            for j, part in enumerate(content):
                _check_part(part, f"{where}.content[{j}]")


def check_content(content: Any, param: str) -> None:
    """One message's content (``param`` names it): an empty array is refused, as OpenAI
    refuses it (an empty string is a turn that says nothing, and is taken); anything
    else is left to the caller.

    Raises:
        APIError: 400 ``param`` for ``[]``.
    """
    if content == []:
        raise invalid(
            f"{param} is an empty array: send at least one content part, or the content as a string",
            param,
        )


def _check_part(part: Any, param: str) -> None:
    if not isinstance(part, dict):
        raise invalid(f"{param} must be an object, got {json_type(part)}: a content part is {_TEXT_PART}",
                      param, INVALID_TYPE)
    kind = field_of(part, "type", f"{param}.type", str, "a string", f"a content part is {_TEXT_PART}")
    if kind == "text":
        field_of(part, "text", f"{param}.text", str, "a string", f"send the text part as {_TEXT_PART}")


def _check_calls(calls: Any, param: str) -> None:
    if not isinstance(calls, list):
        raise invalid(f"{param} must be an array of tool calls, got {json_type(calls)}", param, INVALID_TYPE)
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise invalid(f"{where} must be an object, got {json_type(call)}: {_CALL}", where, INVALID_TYPE)
        function = field_of(call, "function", f"{where}.function", dict, "an object", _CALL)
        field_of(function, "name", f"{where}.function.name", str, "a string", "send the called function's name")
