"""Structured output through a real ``headroom serve`` with the default model: the
openai client's ``response_format`` (json_schema and json_object) and the ollama
client's ``format``; every answer parses and validates against its schema."""

from __future__ import annotations

import json

import jsonschema_rs
import ollama
import openai
import pytest

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_openai_response_format(real_server):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", timeout=600)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for seed in range(3):
        reply = client.chat.completions.create(
            model="default", messages=ASK, response_format=fmt, seed=seed, max_tokens=160
        )
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        jsonschema_rs.validate(CITY, json.loads(reply.choices[0].message.content))
    anything = client.chat.completions.create(
        model="default", messages=ASK, response_format={"type": "json_object"}, max_tokens=96
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="default", messages=ASK, response_format={"type": "json_schema"}
        )
    assert exc.value.body["param"] == "response_format"


def test_a_schema_the_engine_refuses_is_a_400_streamed_or_not(real_server):
    """The grammar compiles in the engine; a streamed call still gets the 400 JSON
    naming ``response_format`` before any event, not a 200 stream carrying an error, and
    a good schema still streams."""
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}
    for stream in (False, True):
        with real_server.client() as http:
            r = http.post("/v1/chat/completions", json={
                "messages": ASK, "response_format": bad, "stream": stream, "max_tokens": 8})
        assert r.status_code == 400, (stream, r.status_code, r.text[:300])
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["param"] == "response_format"
        assert "unclosed" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", timeout=600)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="default", messages=ASK, response_format=fmt, seed=0, max_tokens=160, stream=True) if chunk.choices)
    jsonschema_rs.validate(CITY, json.loads(text))


# Schemas whose every answer the grammar could not hold to: a lookahead pattern (the
# grammar would drop it and answer text the pattern refuses), keywords it does not
# implement, a back-reference.
UNENFORCEABLE = [
    {"type": "object", "properties": {"password": {"type": "string", "pattern": "^(?=.*\\d).+$"}},
     "required": ["password"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}},
    {"type": "string", "pattern": "(ab)\\1"},
]


@pytest.mark.parametrize("schema", UNENFORCEABLE, ids=["lookahead", "uniqueItems", "not", "backreference"])
def test_a_schema_the_grammar_cannot_enforce_is_a_400_not_an_answer(real_server, schema):
    """Fail closed, ``strict`` or not, streamed or not: nothing is generated, and the
    400 names the field in each API's shape (OpenAI's ``param``; Ollama's message)."""
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        for stream in (False, True):
            with real_server.client() as http:
                r = http.post("/v1/chat/completions", json={
                    "messages": ASK, "response_format": fmt, "stream": stream, "max_tokens": 8})
            assert r.status_code == 400, (stream, r.text[:300])
            error = r.json()["error"]
            assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
            assert error["message"].startswith("response_format: the JSON schema cannot be used: ")
    for route, ask in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "Hi"})):
        for stream in (False, True):
            with real_server.client() as http:
                r = http.post(route, json={"model": "default", "format": schema, "stream": stream, **ask})
            assert r.status_code == 400, (route, stream, r.text[:300])
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["error"].startswith("format: the JSON schema cannot be used: ")
    with pytest.raises(ollama.ResponseError) as exc:
        ollama.Client(host=real_server.base_url, timeout=600).chat(model="default", messages=ASK, format=schema)
    assert exc.value.status_code == 400 and "format" in exc.value.error


def test_ollama_format(real_server):
    client = ollama.Client(host=real_server.base_url, timeout=600)
    reply = client.chat(
        model="default", messages=ASK, format=CITY, options={"seed": 1, "num_predict": 160}
    )
    jsonschema_rs.validate(CITY, json.loads(reply.message.content))


def test_a_schema_whose_parse_outgrows_the_grammar_fails_instead_of_a_cut_answer(real_server):
    """1,000 optional properties: after the first value the parser's row passes its limit
    of 2,000 items. The answer then could not go on within the schema; it fails naming
    response_format (Ollama: format) instead of ending there as a complete answer (the
    default model writes ``{"p0": "Hello, World!"`` and stopped with finish_reason stop)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)},
              "required": ["p0"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    with real_server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                    "response_format": fmt, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == "response_format", error
        assert "the JSON schema cannot be enforced" in error["message"] and "2000" in error["message"], error
        r = http.post("/api/chat", json={"model": "default", "messages": [{"role": "user", "content": "Hello"}],
                                         "format": schema, "stream": False, "options": {"temperature": 0}})
        assert r.status_code == 400 and r.json()["error"].startswith("format: "), r.text[:300]
        assert http.get("/api/health").status_code == 200  # and the server goes on


def test_completions_response_format(real_server):
    """``response_format`` on ``/v1/completions`` (vLLM's extension) constrains the text
    as on chat completions, streamed or not; it was dropped unsaid, the answer free text."""
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", timeout=600)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = {"model": "default", "prompt": "Paris is", "max_tokens": 160, "seed": 0}
    reply = client.completions.create(**body, extra_body={"response_format": fmt})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].text
    jsonschema_rs.validate(CITY, json.loads(reply.choices[0].text))
    stream = client.completions.create(**body, stream=True, extra_body={"response_format": fmt})
    jsonschema_rs.validate(CITY, json.loads("".join(chunk.choices[0].text for chunk in stream)))
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**body, extra_body={"response_format": {"type": "yaml"}})
    assert exc.value.body["param"] == "response_format"
