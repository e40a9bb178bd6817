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
boolean, null, object or array (also behind a ``$ref``, in ``anyOf``/``oneOf``/``allOf``
branches or an ``enum``'s values, as Pydantic writes them) is read as JSON (the template writes objects and arrays
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


def _value(text: str, schema: Any, root: Any) -> Any:
    """One parameter's value, typed as its schema says (see the module docstring)."""
    text = text.removeprefix("\n").removesuffix("\n")
    kinds = _types(schema, root)
    if not kinds or "string" in kinds:
        return text
    try:
        return finite_json.loads(text)
    except (ValueError, RecursionError):  # NaN, 1e999 (finite_json), nested past the reader's depth: the text
        return text


def _types(schema: Any, root: Any, seen: tuple[str, ...] = ()) -> set[str]:
    """The JSON types ``schema`` allows (empty: it names none), as Pydantic writes them
    too: a local ``$ref`` followed into ``root`` (the tool's parameters), the branches of
    ``anyOf``, ``oneOf`` and ``allOf``, the types of an ``enum``'s or a ``const``'s values."""
    if not isinstance(schema, dict):
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in seen and len(seen) < _MAX_REFS:
        return _types(_resolve(root, ref), root, (*seen, ref))
    kind = schema.get("type")
    if isinstance(kind, (str, list)):
        return {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)}
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    kinds = {_JSON_TYPES.get(type(v), "object") for v in values}
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) if isinstance(schema.get(key), list) else ():
            kinds |= _types(branch, root, seen)
    return kinds


_MAX_REFS = 32  # a chain of $refs followed this far gives no type: its value stays text
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array"}


def _resolve(root: Any, ref: str) -> Any:
    """What the JSON pointer of a local ``$ref`` (``#/$defs/Place``) names in ``root``, or None."""
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def parse_function(block: str, tools: list[dict[str, Any]] | None) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of the one ``<function=NAME>...</function>`` at
    the start of ``block`` (after whitespace), or None when it is not one: no function,
    or text besides its parameters."""
    match = _FUNCTION.match(block.strip())
    if match is None or match.end() != len(block.strip()):
        return None
    name, body = match.group(1).strip(), match.group(2)
    root = _parameters(tools, name)
    properties = root.get("properties") if isinstance(root.get("properties"), dict) else {}
    arguments = {}
    at = 0
    for param in _PARAMETER.finditer(body):
        if body[at : param.start()].strip():
            return None
        arguments[param.group(1).strip()] = _value(param.group(2), properties.get(param.group(1).strip()), root)
        at = param.end()
    if body[at:].strip():
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _parameters(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The JSON-schema ``parameters`` of function ``name`` among ``tools`` (``{}``: none)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            return params if isinstance(params, dict) else {}
    return {}
