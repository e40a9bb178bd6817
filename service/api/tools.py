"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` in, ``message.tool_calls`` out.

The tool definitions reach the model through its chat template (``tools``); what the
model writes back is parsed by the parser of its family, chosen from the template:

- ``hermes`` (Qwen2.5/3, Hermes, and most tool-tuned open models): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after optional text;
- ``qwen3_xml`` (Qwen3-Coder, Qwen3.5 / Qwen3.6): each call is
  ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``
  after optional text (the wrapper may be missing), values typed by the tool's schema
  (:mod:`service.api.tool_xml`); a Hermes JSON body inside ``<tool_call>`` parses too;
- ``llama3_json`` (Llama 3.1+): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``; several joined by ``;``);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (or, in
  newer templates, ``name[ARGS]{...}``); ``[TOOL_CALLS]`` is a special token, so the
  text may start at the list itself;
- ``harmony`` (gpt-oss): each call is a message of its own,
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``,
  read with the answer's channels by :mod:`service.api.harmony`.

``tool_choice``: ``auto`` (default with tools) parses calls; ``none`` renders the tools
but parses nothing; ``allowed_tools`` of mode ``required`` forces a call to one of the
tools it lists, every tool still rendered, as OpenAI does (mode ``auto`` is refused:
:func:`service.api.tool_checks.tool_choice_of`); ``required`` and a named function start the answer with the
format's call opening (the named function's name included) and constrain the rest to
the call's JSON schema (:func:`forced_call`, through the engine's structured output),
so the call parses and its arguments match the function's ``parameters`` (``qwen3_xml``
forces the Hermes JSON body, which its parser reads as well: the grammar is a JSON
schema's; ``harmony`` names the function in the call's header, outside the grammar, so
``required`` takes one tool only, and a tool's name must fit that header: no whitespace
or ``<``, whatever ``tool_choice``). Answers with calls end with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from service.api import finite_json
from service.api.harmony import (
    CALL,
    call_opening,
    recipient_fault,
    split_harmony,
    template_is_harmony,
)
from service.api.openai.messages import field_of, json_type
from service.api.schema_refs import rebase
from service.api.tool_checks import tool_choice_of, unknown_choice
from service.api.tool_xml import FUNCTION_OPEN, PARAMETER_OPEN, parse_function
from service.common.errors import INVALID_TYPE, invalid

HERMES = "hermes"
QWEN_XML = "qwen3_xml"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
HARMONY = "harmony"

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_TOOL = "each tool must be {'type': 'function', 'function': {'name', 'description', 'parameters'}}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


def parser_for_template(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None when it shows
    none this server parses."""
    if not chat_template:
        return None
    if template_is_harmony(chat_template):
        return HARMONY
    if FUNCTION_OPEN in chat_template and PARAMETER_OPEN in chat_template:  # before Hermes: in <tool_call> too
        return QWEN_XML
    if _HERMES_OPEN in chat_template:
        return HERMES
    if _MISTRAL_TAG in chat_template:
        return MISTRAL
    if _PYTHON_TAG in chat_template or (
        "<|start_header_id|>" in chat_template and "parameters" in chat_template
    ):
        return LLAMA3_JSON
    return None


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(name=obj["name"], arguments=text)


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends."""
    stripped = text.lstrip()
    try:
        value, end = finite_json.DECODER.raw_decode(stripped)
    except (ValueError, RecursionError):  # NaN, 1e999 (finite_json), or nested past the reader's depth: not a call
        return None
    return value, len(text) - len(stripped) + end


def parse_tool_calls(
    fmt: str, text: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[ToolCall]]:
    """A whole answer as ``(content, calls)``. Text that does not parse as calls
    stays content: a model that meant to answer in words is never turned into a call.

    Args:
        fmt: :data:`HERMES`, :data:`QWEN_XML`, :data:`LLAMA3_JSON`, :data:`MISTRAL` or
            :data:`HARMONY`.
        text: the model's answer (special tokens left out, as the API shows it).
        tools: the request's tool definitions: :data:`QWEN_XML` types its parameter
            values by their schemas.
    """
    if fmt == QWEN_XML:
        return _parse_xml(text, tools)
    if fmt == HARMONY:  # the reasoning left out: service.api.chat_output keeps it
        _, content, found = split_harmony(text)
        return content, [ToolCall(c.name, c.arguments) for c in found]
    if fmt == HERMES:
        start = text.find(_HERMES_OPEN)
        if start < 0:
            return text, []
        blocks = _HERMES_BLOCK.findall(text, start)
        if not blocks:
            # One unclosed block (cut by max_tokens, or the end token came first).
            blocks = [text[start + len(_HERMES_OPEN) :]]
        calls = []
        for block in blocks:
            parsed = _json_prefix(block)
            call = _call(parsed[0], "arguments") if parsed else None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].rstrip(), calls
    if fmt == LLAMA3_JSON:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_top_level(body, ";"):
            parsed = _json_prefix(part)
            call = _call(parsed[0], "parameters") if parsed else None
            if call is None or part[parsed[1] :].strip():
                return text, []
            calls.append(call)
        return "", calls
    if fmt == MISTRAL:
        start = text.find(_MISTRAL_TAG)
        content, body = (
            (text[:start], text[start + len(_MISTRAL_TAG) :]) if start >= 0 else ("", text)
        )
        body = body.strip()
        if _MISTRAL_ARGS in body:
            calls = []
            for chunk in body.split(_MISTRAL_TAG):
                name, _, args = chunk.partition(_MISTRAL_ARGS)
                parsed = _json_prefix(args)
                if not name.strip() or parsed is None:
                    return text, []
                calls.append(_call({"name": name.strip(), "arguments": parsed[0]}, "arguments"))
            return content.rstrip(), [c for c in calls if c is not None]
        parsed = _json_prefix(body) if body.startswith("[") else None
        if parsed is None or not isinstance(parsed[0], list):
            return text, []
        calls = [_call(obj, "arguments") for obj in parsed[0]]
        if not calls or any(c is None for c in calls):
            return text, []
        return content.rstrip(), calls  # type: ignore[return-value]
    raise ValueError(f"unknown tool-call format {fmt!r}")


def _parse_xml(text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """:func:`parse_tool_calls` for :data:`QWEN_XML`: the calls from the first
    ``<tool_call>`` or ``<function=`` on; text after the last call is left out, as
    :data:`HERMES` does."""
    starts = [at for at in (text.find(_HERMES_OPEN), text.find(FUNCTION_OPEN)) if at >= 0]
    if not starts:
        return text, []
    start = min(starts)
    calls = []
    for block in _xml_blocks(text[start:]):
        parsed = _json_prefix(block) if block.lstrip().startswith("{") else None
        call = _call(parsed[0], "arguments") if parsed and not block[parsed[1] :].strip() else None
        if call is None:
            function = parse_function(block, tools)
            if function is None:
                return text, []
            call = ToolCall(*function)
        calls.append(call)
    return text[:start].rstrip(), calls


def _xml_blocks(text: str) -> list[str]:
    """The call bodies of ``text`` (which starts at a call): each ``<tool_call>``'s
    (an unclosed last one to the end), or a bare ``<function=...>...</function>``."""
    blocks, close = [], "</function>"
    rest = text.lstrip()
    while rest.startswith((_HERMES_OPEN, FUNCTION_OPEN)):
        if rest.startswith(_HERMES_OPEN):
            body, _, rest = rest[len(_HERMES_OPEN) :].partition(_HERMES_CLOSE)
        else:
            end = rest.find(close)
            end = len(rest) if end < 0 else end + len(close)
            body, rest = rest[:end], rest[end:]
        blocks.append(body)
        rest = rest.lstrip()
    return blocks


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped = not escaped and ch == "\\"
            if ch == '"' and not escaped:
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def call_start(fmt: str, text: str) -> int | None:
    """Where a tool-call section may begin in a streamed answer so far, or None when
    none can have begun: the text before it is safe to send as content. A marker cut
    at the end of ``text`` counts as begun (it is held back)."""
    if fmt in (HERMES, QWEN_XML):
        openings = (_HERMES_OPEN,) if fmt == HERMES else (_HERMES_OPEN, FUNCTION_OPEN)
        found = [at for at in (text.find(o) for o in openings) if at >= 0]
        if found:
            return min(found)
        for n in range(min(max(len(o) for o in openings) - 1, len(text)), 0, -1):
            if any(o.startswith(text[-n:]) for o in openings):
                return len(text) - n
        return None
    # Llama 3 and Mistral answer with the call alone: decided by the answer's start.
    stripped = text.lstrip()
    if not stripped:
        return 0
    markers = ("{", _PYTHON_TAG) if fmt == LLAMA3_JSON else ("[", _MISTRAL_TAG)
    if any(stripped.startswith(m) or m.startswith(stripped) for m in markers):
        return 0
    if fmt == MISTRAL:
        at = text.find(_MISTRAL_TAG)
        return at if at >= 0 else None
    return None


# Per format: (opening of a call before its name, the arguments' key, closing).
_CALL_SHAPE = {
    HERMES: (_HERMES_OPEN + "\n", "arguments", "\n" + _HERMES_CLOSE),
    QWEN_XML: (_HERMES_OPEN + "\n", "arguments", "\n" + _HERMES_CLOSE),  # the JSON body, which it parses
    LLAMA3_JSON: ("", "parameters", ""),
    MISTRAL: (_MISTRAL_TAG + "[", "arguments", "]"),
}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def forced_call(fmt: str, tools: list[dict[str, Any]], name: str | None) -> tuple[str, str, str]:
    """``(prefix, json_schema, suffix)`` of a forced call: the answer starts with
    ``prefix`` (rendered after the generation prompt), the model writes a value of
    ``json_schema`` under grammar-constrained sampling, and ``suffix`` closes the call
    for the parser. Named: the prefix holds the name, the schema is the function's
    ``parameters``. ``required``: the schema is any one of the tools' calls (its name
    and its arguments), each tool's local ``$ref`` pointing where its parameters moved.

    Raises:
        RecursionError: parameters nested past Python's recursion depth.
    """
    if fmt == HARMONY:
        name = name or tools[0]["function"]["name"]  # required: one tool (plan_tools)
        tool = next(t for t in tools if t["function"]["name"] == name)
        return call_opening(name), json.dumps(_parameters(tool)), CALL
    opening, key, closing = _CALL_SHAPE[fmt]
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        prefix = opening + json.dumps({"name": name})[:-1] + f', "{key}": '
        return prefix, json.dumps(_parameters(tool)), "}" + closing
    # Each tool's parameters move under its call's arguments: their $refs follow.
    at = [f"/properties/{key}"] if len(tools) == 1 else [f"/anyOf/{i}/properties/{key}" for i in range(len(tools))]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, key: rebase(_parameters(t), pointer)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t, pointer in zip(tools, at, strict=True)
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return opening, json.dumps(schema), closing


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` and ``tool_choice`` mean for its answer.

    ``tools``: the definitions for the template (None: no tools). ``parse``: the
    format to parse the answer with (None: no parsing). ``prefix``: text the answer
    starts with (rendered after the generation prompt, and prepended to the model's
    text before parsing); ``schema``: the JSON schema the model's text is constrained
    to (a forced call's arguments); ``suffix``: text appended before parsing (the
    call's closing, which the grammar leaves out)."""

    tools: list[dict[str, Any]] | None = None
    parse: str | None = None
    prefix: str = ""
    schema: str | None = None
    suffix: str = ""


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, chat_template: str | None, has_tools: bool
) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` against each other, then against the template
    (a malformed request is named as such even on a model without tool support).

    Raises:
        APIError: 400 ``tools`` (``tools[i]``) for a malformed definition (``parameters``
            that are not an object, an empty name, a name given twice) or a template with no tool
            support (or a format this server does not parse); 400 ``tools[i].function.name``
            absent (``missing_field``), no string (``invalid_type``) or a name harmony's
            call header cannot carry; each ``tools[i]`` refusal's message starts with
            the field (Ollama's error shape has no ``param``); 400 ``tool_choice`` for
            a value :func:`service.api.tool_checks.tool_choice_of` refuses (one of the
            wrong JSON type, ``5``: ``invalid_type``, tools or not); 400 ``tools``
            (``too_deep``) for a forced call's parameters nested past the copy's depth.
    """
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            if tool_choice != "required" and not isinstance(tool_choice, dict):
                raise unknown_choice(tool_choice)  # a value no call could take, tools or not
            raise invalid("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"  # each message starts with the field: Ollama's error shape has no param
        if not isinstance(tool, dict):
            raise invalid(f"{where} must be an object, got {json_type(tool)}: {_TOOL}", where, INVALID_TYPE)
        if tool.get("type", "function") != "function":
            raise invalid(f"{where}: {_TOOL}", where)
        function = field_of(tool, "function", f"{where}.function", dict, "an object", _TOOL)
        name = field_of(function, "name", f"{where}.function.name", str, "a string", _TOOL)
        if function.get("parameters") is not None:
            field_of(function, "parameters", f"{where}.function.parameters", dict, "a JSON schema object", _TOOL)
        if not name.strip():  # a call could not name it
            raise invalid(f"{where}: a function needs a name", where)
        if name in names:  # a call could not say which one it calls
            raise invalid(f"{where}: tool names must be unique: {name!r} is given twice", where)
        names.append(name)
    choice = tool_choice_of(tool_choice, names)  # the request's own shape first, then the model's abilities
    if not has_tools:
        raise invalid(
            "this model's chat template has no tool support (it renders no tools), so "
            "tools cannot be used with this model",
            "tools",
        )
    fmt = parser_for_template(chat_template)
    if fmt is None:
        raise invalid(
            "this model's chat template uses a tool-call format this server does not parse "
            "(it parses Hermes/Qwen <tool_call>, Qwen3.5's <function=...> XML, Llama 3 JSON, "
            "Mistral [TOOL_CALLS] and gpt-oss's harmony)",
            "tools",
        )
    if fmt == HARMONY:  # every call, forced or the model's own, names its function in its header
        for i, name in enumerate(names):
            if (fault := recipient_fault(name)) is not None:
                raise invalid(fault, f"tools[{i}].function.name")
    if choice.allowed is not None:  # allowed_tools: the forced call takes one of them (all are rendered)
        tools = [t for t in tools if t["function"]["name"] in choice.allowed]
    if choice.mode == "none":
        return ToolPlan(tools=tools)
    if choice.mode == "auto":
        return ToolPlan(tools=tools, parse=fmt)
    if choice.mode == "required" and fmt == HARMONY and len(tools) > 1:
        raise invalid(
            "tool_choice 'required' with several tools is not supported for this model "
            "(its call names the function outside the JSON the grammar constrains); name "
            "one function in tool_choice",
            "tool_choice",
        )
    try:
        prefix, schema, suffix = forced_call(fmt, tools, choice.name)  # required, or the function named
    except RecursionError:  # the body decoder's depth is larger than the schema copy's
        raise invalid("a tool's parameters are nested too deeply for a forced call; flatten them", "tools",
                      code="too_deep") from None
    return ToolPlan(tools=tools, parse=fmt, prefix=prefix, schema=schema, suffix=suffix)
