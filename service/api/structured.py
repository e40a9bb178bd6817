"""Structured output: OpenAI's ``response_format`` (and Ollama's ``format``) as the JSON
schema the engine constrains sampling with (:mod:`engine.sampling.grammar`).

``{"type": "text"}`` (or none): free text. ``{"type": "json_object"}``: any JSON
object. ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: a
value matching ``schema``; every answer is constrained, ``strict`` or not. A boolean
schema is JSON Schema's: ``true`` takes any JSON value (as ``{}``), ``false`` none (a
400). A schema the
grammar compiler cannot take is a 400 naming ``response_format`` (from the engine).
"""

from __future__ import annotations

import json
from typing import Any

from service.common.errors import INVALID_TYPE, invalid

ANY_OBJECT = '{"type": "object"}'


# Where a ``json_schema`` format holds its schema, by the field that carries it.
_SCHEMA_SHAPES = {
    "response_format": '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
    "text.format": '{"type": "json_schema", "name": ..., "schema": {...}}',
    "output_config.format": '{"type": "json_schema", "schema": {...}}',
}
# Where a ``json_schema`` format's own fields are named, by the field that carries it.
_FIELD_PATHS = {"response_format": "response_format.json_schema", "text.format": "text.format"}
# A json_schema format's fields beside its schema, and the JSON type each must have.
_FIELD_TYPES = {"name": (str, "a string"), "description": (str, "a string"), "strict": (bool, "a boolean")}


def _check_fields(holder: dict[str, Any], param: str) -> None:
    """Refuse a ``name``, ``description`` or ``strict`` of another JSON type than
    OpenAI's (absent or null is taken).

    Raises:
        APIError: 400 ``invalid_type`` naming the field (``text.format.strict``).
    """
    for field, (kind, words) in _FIELD_TYPES.items():
        value = holder.get(field)
        if value is not None and not isinstance(value, kind):
            where = f"{_FIELD_PATHS.get(param, param)}.{field}"
            raise invalid(f"{where} must be {words}, got {json.dumps(value)[:40]}", where, INVALID_TYPE)


def response_schema(response_format: dict[str, Any] | None, param: str = "response_format") -> str | None:
    """The JSON text of the schema an answer must match, or None for free text.
    ``param`` is the field the format came from: chat completions' ``response_format``
    (the schema under ``json_schema``), Responses' ``text.format`` or Anthropic's
    ``output_config.format`` (the schema beside its ``type``).

    Raises:
        APIError: 400 ``invalid_type`` naming ``param.type`` for a type that is no
            string; 400 ``param`` for an unknown type, a ``json_schema`` without a
            ``schema`` object (naming the shape that field takes) or with ``false``;
            400 ``invalid_type`` naming its ``name``, ``description`` or ``strict``
            when one is of another JSON type (:func:`_check_fields`).
    """
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if not isinstance(kind, str):
        raise invalid(f"{param}.type must be a string (text, json_object or json_schema), got "
                      f"{json.dumps(kind)[:40]}", f"{param}.type", INVALID_TYPE)
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        holder = response_format.get("json_schema") if param == "response_format" else response_format
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if isinstance(holder, dict):
            _check_fields(holder, param)
        if schema is True:  # JSON Schema's boolean form: true takes any JSON value
            schema = {}
        elif schema is False:
            raise invalid(
                f"{param} json_schema's schema is false, which no value matches, so no "
                "answer can be written: send a schema object, or true for any JSON value",
                param,
            )
        if not isinstance(schema, dict):
            raise invalid(f"{param} json_schema needs {_SCHEMA_SHAPES[param]}", param)
        return json.dumps(schema)
    raise invalid(f"{param} type {kind!r} is not supported; use text, json_object or json_schema", param)


def ollama_format(fmt: Any) -> str | None:
    """The JSON text of the schema Ollama's ``format`` (``"json"``: any object, or a
    JSON schema object) constrains an answer to, or None for free text.

    Raises:
        APIError: 400 ``format`` for anything else.
    """
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return ANY_OBJECT
    if isinstance(fmt, dict):
        return json.dumps(fmt)
    raise invalid('format must be "json" or a JSON schema object', "format")
