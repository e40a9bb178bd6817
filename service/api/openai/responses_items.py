"""The fields of one Responses ``input`` item, read and checked with the codes of
docs/api.md's Errors, as chat completions' messages are
(:mod:`service.api.openai.messages`): a required field absent is ``missing_field``, one
of the wrong JSON type ``invalid_type``, a value not served ``invalid_value``, each
naming the nested field (``input[2].call_id``, ``input[0].content[1]``).

- a message's ``role`` (``developer`` is ``system``) and its text (:func:`message_role`,
  :func:`message_text`);
- a ``function_call``'s ``call_id``, ``name`` and ``arguments`` (:func:`call_fields`),
  a ``function_call_output``'s ``call_id`` (:func:`output_call_id`);
- a ``reasoning`` item's ``reasoning_text`` (:func:`reasoning_text`).
"""

from __future__ import annotations

from typing import Any

from service.api.openai.messages import check_content, field_of, json_type
from service.api.tool_checks import check_call_arguments, check_tool_name
from service.common.errors import INVALID_TYPE, MISSING_FIELD, invalid

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_CALL = 'a function_call is {"type": "function_call", "call_id": ..., "name": ..., "arguments": "{...}"}'
_OUTPUT = 'a function_call_output is {"type": "function_call_output", "call_id": ..., "output": ...}'


def message_role(item: dict[str, Any], param: str) -> str:
    """A message item's role as the chat's (``developer`` is ``system``).

    Raises:
        APIError: 400 ``param``: ``missing_field`` without one, ``invalid_type`` for one
            that is no string, ``invalid_value`` for another role.
    """
    if "role" not in item:
        raise invalid("role is missing: a message item needs user, assistant, system or developer", param,
                      MISSING_FIELD)
    role = item["role"]
    if not isinstance(role, str):
        raise invalid(f"role must be a string (user, assistant, system or developer), got {json_type(role)}",
                      param, INVALID_TYPE)
    if role not in _ROLES:
        raise invalid("role must be user, assistant, system or developer", param)
    return _ROLES[role]


def message_text(content: Any, param: str, role: str = "user") -> str:
    """A message's content as text: a string, or its text parts joined (an assistant's
    ``refusal`` parts among them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"content must be a string or a list of content parts, got {json_type(content)}", param,
                      INVALID_TYPE)
    check_content(content, param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(
                f"{kind} is not supported: this model has no vision or file input (text only)",
                f"{param}[{j}]",
            )
        else:
            raise invalid(
                "each content part must be {'type': 'input_text' or 'output_text', 'text': ...}",
                f"{param}[{j}]",
            )
    return "".join(texts)


def call_fields(item: dict[str, Any], param: str) -> tuple[str, str, str]:
    """A ``function_call`` item's ``(call_id, name, arguments)``; ``arguments`` absent,
    null or empty is ``"{}"``.

    Raises:
        APIError: 400 ``param.call_id`` / ``param.name``: ``missing_field`` or
            ``invalid_type``; ``param.arguments`` that is no string (``invalid_type``)
            or no JSON object text; ``param.name`` that no tool could have
            (:mod:`service.api.tool_checks`).
    """
    call_id = field_of(item, "call_id", f"{param}.call_id", str, "a string", _CALL)
    name = field_of(item, "name", f"{param}.name", str, "a string", _CALL)
    arguments = item.get("arguments") or "{}"
    if not isinstance(arguments, str):  # JSON text in this API, never an object
        field_of(item, "arguments", f"{param}.arguments", str, "a string", _CALL)
    check_tool_name(name, f"{param}.name")
    check_call_arguments(arguments, f"{param}.arguments")
    return call_id, name, arguments


def output_call_id(item: dict[str, Any], param: str) -> str:
    """A ``function_call_output`` item's ``call_id``.

    Raises:
        APIError: 400 ``param.call_id``: ``missing_field`` or ``invalid_type``.
    """
    return field_of(item, "call_id", f"{param}.call_id", str, "a string", _OUTPUT)


def reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's ``content`` parts' text joined (none: no text).

    Raises:
        APIError: 400 naming ``content``, a part or its ``text`` absent or of another type.
    """
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise invalid(f"content must be a list of reasoning_text parts, got {json_type(parts)}",
                      f"{param}.content", INVALID_TYPE)
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            where = f"{param}.content[{j}]" + (".text" if isinstance(part, dict) else "")
            raise invalid("each content part must be {'type': 'reasoning_text', 'text': ...}", where,
                          MISSING_FIELD if isinstance(part, dict) and "text" not in part else INVALID_TYPE)
    return "".join(part["text"] for part in parts)
