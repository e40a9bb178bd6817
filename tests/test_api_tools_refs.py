"""A forced call's grammar (tool_choice "required", Anthropic's "any") for tools whose
parameters point into themselves with ``$ref``, as Pydantic writes them; no server."""

from __future__ import annotations

import json

import jsonschema_rs
import llguidance
import pytest
from test_api_tools import WEATHER

from engine.sampling.grammar import _JSON_OPTIONS
from service.api.tools import HERMES, LLAMA3_JSON, MISTRAL, QWEN_XML, plan_tools
from service.common.errors import APIError

PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# As Pydantic writes a tool's parameters (the openai SDK's pydantic_function_tool):
# nested models in $defs, pointed at from the parameters' root.
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Place": PLACE}, "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Place"}, "via": {"type": "array", "items": {"$ref": "#/$defs/Place"}},
                   "enum": {"type": "object", "properties": {"$ref": {"type": "string"}}}},
    "required": ["to"]}}}


@pytest.mark.parametrize("fmt", [HERMES, QWEN_XML, LLAMA3_JSON, MISTRAL])
@pytest.mark.parametrize("tools", [[BOOK], [WEATHER, BOOK]], ids=["one", "two"])
def test_a_required_call_to_a_tool_with_refs_keeps_what_they_point_at(fmt, tools):
    """tool_choice "required" (Anthropic's "any") with a tool whose parameters use
    ``$defs`` was a 400 ``tools: the JSON schema cannot be used: Pointer '/$defs/Place'
    does not exist``: the forced call's grammar nests the parameters under the call's
    arguments, where a pointer from their root names nothing. Now the pointers follow."""
    template = {HERMES: "<tool_call>", QWEN_XML: "<tool_call><function=<parameter=", LLAMA3_JSON: "<|python_tag|>",
                MISTRAL: "[TOOL_CALLS]"}
    plan = plan_tools(tools, "required", "{{ tools }}" + template[fmt], True)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(plan.schema, overrides=_JSON_OPTIONS)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    valid = jsonschema_rs.validator_for(json.loads(plan.schema)).is_valid
    assert valid({"name": "book", key: {"to": {"city": "Oslo"}, "via": [{"city": "Rome"}], "enum": {"$ref": "x"}}})
    assert not valid({"name": "book", key: {"to": {"town": "Oslo"}}})
    assert not valid({"name": "book", key: {"to": {"city": "Oslo"}, "via": [{"city": 1}]}})
    assert BOOK["function"]["parameters"]["properties"]["to"] == {"$ref": "#/$defs/Place"}  # the request's own, as sent


def test_a_forced_call_to_parameters_nested_past_the_copy_s_depth_is_a_400():
    """The body decoder takes JSON a few frames deeper than the forced call's copy of the
    parameters reaches under a server's stack: that call is a 400 naming ``tools``, not
    a 500 RecursionError."""
    deep = {"type": "string"}
    for _ in range(600):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(APIError) as err:
        plan_tools([tool], "required", "{{ tools }}<tool_call>", True)
    assert err.value.status == 400 and err.value.param == "tools" and "nested too deeply" in str(err.value)
