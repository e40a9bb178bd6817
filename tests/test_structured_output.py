"""Structured output on the CPU engine: a tiny random-weight Qwen3 (whose unconstrained
text is noise) answers 20 seeded json_schema requests, and every answer parses and
validates against its schema, because the grammar leaves it no other token."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from engine.common.config import EngineConfig
from engine.common.errors import RequestRejected
from engine.core.engine import Engine
from engine.sampling.grammar import xgrammar_reason
from engine.text.tokenizer import load_tokenizer
from engine.wire.messages import ERROR_INVALID_SCHEMA, GenerateRequest, SamplingParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-qwen3-json")
    make_tiny_hf_model(
        "qwen3", folder, vocab_size=len(smollm_tokenizer), max_position_embeddings=512
    )
    smollm_tokenizer.save_pretrained(folder)
    return Engine(EngineConfig(model=str(folder), device="cpu", num_pages=64))


def _run(engine: Engine, requests: dict[str, SamplingParams], prompt: list[int]) -> dict:
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons = {}
    for rid, sp in requests.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp))
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return out, reasons


def test_20_seeded_json_schema_answers_all_validate(tiny_engine):
    tokenizer = load_tokenizer(str(tiny_engine.model_dir))
    prompt = tokenizer.encode("Answer in JSON:")
    requests = {
        f"r{seed}": SamplingParams(
            max_new_tokens=64,
            temperature=1.0,
            seed=seed,
            json_schema=json.dumps(SCHEMAS[seed % 2]),
        )
        for seed in range(20)
    }
    out, reasons = _run(tiny_engine, requests, prompt)
    for seed in range(20):
        rid = f"r{seed}"
        text = tokenizer.decode(out[rid], skip_special_tokens=True)
        assert reasons[rid] == "stop", (rid, text)  # the value closed, then the end token
        jsonschema_rs.validate(SCHEMAS[seed % 2], json.loads(text))
    # Unconstrained, the same model says no JSON at all.
    free, _ = _run(tiny_engine, {"free": SamplingParams(max_new_tokens=16, seed=0)}, prompt)
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free["free"], skip_special_tokens=True))


def _refusal(engine: Engine, rid: str, sp: SamplingParams) -> str:
    """Why the engine refused ``sp``'s schema: at once (a schema compiled before fails
    in ``add_request``) or, compiled in the background, with the request's one output."""
    try:
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=[1, 2], sampling=sp))
    except RequestRejected as exc:
        assert exc.param == "response_format"
        return str(exc)
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid:
                assert o.finished and o.finish_reason == "error" and not o.token_ids, o
                assert o.error_code == ERROR_INVALID_SCHEMA
                return o.error_message
    raise AssertionError("the request was not refused")


def test_bad_schema_is_rejected_naming_response_format(tiny_engine):
    bad = SamplingParams(max_new_tokens=4, json_schema='{"type": "no-such-type"}')
    message = _refusal(tiny_engine, "bad", bad)
    # xgrammar's reason alone: no log time, C++ source line or trailing newline.
    assert message == 'the JSON schema cannot be used: Unsupported type "no-such-type"'
    broken = SamplingParams(max_new_tokens=4, json_schema="{not json")
    message = _refusal(tiny_engine, "broken", broken)
    assert message.startswith("the JSON schema cannot be used: Failed to parse JSON"), message
    assert ".cc:" not in message and "Check failed" not in message


def test_xgrammar_reason_drops_the_log_prefix():
    raised = RuntimeError(
        '[03:53:55] /project/cpp/json_schema_converter.cc:5082: Unsupported type "nonsense"\n'
    )
    assert xgrammar_reason(raised) == 'Unsupported type "nonsense"'
    assert xgrammar_reason(ValueError("plain words")) == "plain words"


def test_json_is_one_line_with_the_documented_separators(tiny_engine):
    """What the README promises of the JSON's whitespace: the grammar takes `, ` and `: `
    between items and nothing else outside strings."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                         "required": ["a", "b"], "additionalProperties": False})
    grammars = tiny_engine._grammars()
    compiled = grammars.compile(schema).result(timeout=300)

    def accepts(text: str) -> bool:
        matcher = grammars.matcher_of(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(json.dumps({"a": 1, "b": "x y"}))
    assert not accepts('{"a": 1, "b": "x y"')  # not complete
    for other in ('{"a":1,"b":"x y"}', '{"a": 1,"b": "x y"}', '{ "a": 1, "b": "x y"}', '{"a":  1, "b": "x y"}'):
        assert not accepts(other), other


def test_slow_compile_fails_in_bounded_time_and_the_grammar_is_kept(tiny_engine):
    """A compile past the limit fails its request (while other requests' steps go on);
    the grammar it was making is kept, so the same schema later is served at once."""
    grammars = tiny_engine._grammars()
    big = {"type": "object", "properties": {
        f"field{i}": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                                       "b": {"enum": [f"v{j}" for j in range(20)]}}}
        for i in range(60)}}
    sp = SamplingParams(max_new_tokens=4, json_schema=json.dumps(big))
    limit = grammars.timeout_s
    grammars.timeout_s = 0.0
    try:
        assert "did not compile within 0 s" in _refusal(tiny_engine, "slow", sp)
        grammars.compile(sp.json_schema).result(timeout=300)
        out, reasons = _run(tiny_engine, {"again": sp}, [1, 2])
        assert reasons["again"] in ("stop", "length")
    finally:
        grammars.timeout_s = limit
