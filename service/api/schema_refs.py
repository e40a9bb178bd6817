"""A JSON schema moved inside another keeps what its ``$ref``s point at.

A tool's ``parameters`` point from their own root: Pydantic's schemas (the openai SDK's
``pydantic_function_tool``, LangChain's tools) keep nested models in ``$defs`` and name
them ``{"$ref": "#/$defs/Place"}``. A forced call's grammar
(:func:`service.api.tools.forced_call`) puts each tool's parameters under its call's
``arguments``, where such a pointer names nothing; :func:`rebase` points each local
``$ref`` at the place the schema moved to.
"""

from __future__ import annotations

from typing import Any

# Keywords whose values map names to schemas (a name is no keyword), and those whose
# values are data (a "$ref" key there is no reference).
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"const", "enum", "default", "examples"})


def rebase(schema: Any, pointer: str) -> Any:
    """A copy of ``schema`` whose local ``$ref``s (``#``, ``#/...``) start at ``pointer``,
    the JSON pointer of the place it moves to (``/properties/arguments``); other
    references and values as they are.

    Raises:
        RecursionError: a schema nested past Python's recursion depth.
    """
    if isinstance(schema, list):
        return [rebase(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            value = "#" + pointer + value[1:]
        elif key in _NAMED and isinstance(value, dict):
            value = {name: rebase(item, pointer) for name, item in value.items()}
        elif key not in _DATA:
            value = rebase(value, pointer)
        out[key] = value
    return out
