"""The XML tool-call body of Qwen3-Coder and Qwen3.5 / Qwen3.6 templates::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags (the newline after the opening tag and
the one before the closing tag are the format's, not the value's). Its type is the one
the tool's JSON schema gives that parameter: a string stays text; a number, integer,
boolean, null, object or array is read as JSON (the template writes objects and arrays
with ``tojson``), and stays text where it does not parse (``NaN``, ``1e999``:
:mod:`service.api.finite_json`). A parameter the schema does
not name stays text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from service.api import finite_json

FUNCTION_OPEN = "<function="
PARAMETER_OPEN = "<parameter="
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _value(text: str, schema: dict[str, Any] | None) -> Any:
    """One parameter's value, typed as its schema says (see the module docstring)."""
    text = text.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return finite_json.loads(text)
    except (ValueError, RecursionError):  # NaN, 1e999 (finite_json), nested past the reader's depth: the text
        return text


def parse_function(block: str, tools: list[dict[str, Any]] | None) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of the one ``<function=NAME>...</function>`` at
    the start of ``block`` (after whitespace), or None when it is not one: no function,
    or text besides its parameters."""
    match = _FUNCTION.match(block.strip())
    if match is None or match.end() != len(block.strip()):
        return None
    name, body = match.group(1).strip(), match.group(2)
    properties = _properties(tools, name)
    arguments = {}
    at = 0
    for param in _PARAMETER.finditer(body):
        if body[at : param.start()].strip():
            return None
        arguments[param.group(1).strip()] = _value(param.group(2), properties.get(param.group(1).strip()))
        at = param.end()
    if body[at:].strip():
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The JSON-schema ``properties`` of function ``name`` among ``tools`` (``{}``: none)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}
