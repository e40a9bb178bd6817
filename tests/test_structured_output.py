"""Structured output on the CPU engine: a tiny random-weight Qwen3 (whose unconstrained
text is noise) answers 20 seeded json_schema requests, and every answer parses and
validates against its schema, because the grammar leaves it no other token."""

from __future__ import annotations

import json
import threading

import jsonschema_rs
import pytest

from engine.common.config import EngineConfig
from engine.common.errors import RequestRejected
from engine.core.engine import Engine
from engine.sampling.grammar import grammar_reason
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
    assert message == "the JSON schema cannot be used: Invalid type: no-such-type"
    broken = SamplingParams(max_new_tokens=4, json_schema="{not json")
    message = _refusal(tiny_engine, "broken", broken)
    assert message.startswith("the JSON schema cannot be used: "), message
    assert "\n" not in message and "<state>" not in message


# Schemas with a keyword or pattern the grammar cannot enforce, and a word of the reason
# each is refused with: answering them would give text the schema rejects.
UNENFORCEABLE = [
    ({"type": "string", "pattern": "^(?=.*\\d).+$"}, "look-around"),
    ({"type": "string", "pattern": "(?<!x)y"}, "look-around"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreferences"),
    ({"type": "string", "pattern": "\\bfoo\\b"}, "lookarounds"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]}, "oneOf"),
    ({"type": "string", "format": "no-such-format"}, "format"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "maxProperties"),
]


@pytest.mark.parametrize(("schema", "word"), UNENFORCEABLE, ids=[w for _, w in UNENFORCEABLE])
def test_a_schema_the_grammar_cannot_enforce_is_refused(tiny_engine, schema, word):
    """Fail closed: nothing generated for a schema the grammar would only approximate;
    the reason is the library's, on one line. A lenient or coercing option the schema
    asks for itself (``x-guidance``) is overridden."""
    schema = {**schema, "x-guidance": {"lenient": True, "coerce_one_of": True}}
    sp = SamplingParams(max_new_tokens=4, json_schema=json.dumps(schema))
    message = _refusal(tiny_engine, f"unenforceable-{len(sp.json_schema)}-{word}", sp)
    assert message.startswith("the JSON schema cannot be used: ") and word in message, message
    assert "\n" not in message


def test_a_schema_that_only_refers_to_itself_is_refused_in_words(tiny_engine):
    """``{"$ref": "#"}`` compiles but lets no token start a value: it was refused at the
    first step with llguidance's internal words, ``the JSON schema cannot be enforced:
    NoExtensionBias <non-verbose/>``. Now the compile finds it, and the reason says
    what is wrong with the schema."""
    for i, schema in enumerate(({"$ref": "#"}, {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]})):
        sp = SamplingParams(max_new_tokens=4, json_schema=json.dumps(schema))
        message = _refusal(tiny_engine, f"self-ref-{i}", sp)
        assert message.startswith("the JSON schema cannot be used: ") and "matches no JSON value" in message
        assert "NoExtensionBias" not in message and "<non-verbose/>" not in message, message


def test_a_schema_that_requires_itself_is_refused_in_words(tiny_engine):
    """A required property (or an item of a non-empty array) whose schema is the whole
    schema forces ``{"a": {"a": ...`` without end: it was refused with the parser's advice,
    ``Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes``,
    which names nothing the client wrote. Now the reason says what the schema does."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    sp = SamplingParams(max_new_tokens=4, json_schema=json.dumps(schema))
    tiny_engine.add_request(GenerateRequest(request_id="requires-itself", prompt_token_ids=[1, 2], sampling=sp))
    ended = []
    while tiny_engine.has_work():
        ended += [o for o in tiny_engine.step() if o.finished]
    assert [o.finish_reason for o in ended] == ["error"] and ended[0].error_code == ERROR_INVALID_SCHEMA
    message = ended[0].error_message
    assert message.startswith("the JSON schema cannot be enforced: ") and "without end" in message, message
    assert "single-byte" not in message and "ff_tokens" not in message, message


def test_grammar_reason_is_one_line():
    raised = "regex parse error:\n    (a)\\1\n       ^^\nerror: backreferences are not supported\n"
    assert grammar_reason(raised) == "regex parse error: (a)\\1 error: backreferences are not supported"
    assert grammar_reason("plain words") == "plain words"
    assert grammar_reason("Parser Error: too many items\n<non-verbose/>") == "Parser Error: too many items"


def test_a_byte_level_bpe_built_with_byte_fallback_keeps_its_bytes_for_the_grammar(default_model_dir):
    """transformers 5.17 builds the default model's tokenizer (read from its GGUF) with
    sentencepiece's byte fallback; llguidance then read the token 'Ġ"' as the bytes
    C4 A0 22, its mask allowed it after '{"city":' and its parser refused it (the
    answer failed invalid_schema on the GPU machine). The grammar's view keeps the bytes."""
    import llguidance
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from engine.sampling.grammar import llguidance_tokenizer_json

    spec = json.loads(load_tokenizer(default_model_dir).backend_tokenizer.to_str())
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, spec["decoder"]]}
    as_built = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    ids = as_built.encode(' "Paris"', add_special_tokens=False)
    assert as_built.decode(ids) == ' "Paris"'  # transformers decodes it right
    assert llguidance.LLTokenizer(as_built.backend_tokenizer.to_str()).decode_bytes(ids) != b' "Paris"'
    assert llguidance.LLTokenizer(llguidance_tokenizer_json(as_built)).decode_bytes(ids) == b' "Paris"'


def test_json_is_one_line_with_the_documented_separators(tiny_engine):
    """What the README promises of the JSON's whitespace: the grammar takes `, ` and `: `
    between items and nothing else outside strings."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                         "required": ["a", "b"], "additionalProperties": False})
    grammars = tiny_engine._grammars()
    compiled = grammars.compile(schema).result(timeout=300)

    def accepts(text: str) -> bool:
        return grammars.accepts(compiled, text)

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
    # The compile thread is held busy, so the compile cannot finish before its deadline.
    busy = threading.Event()
    grammars._pool.submit(busy.wait, 300)
    try:
        assert "did not compile within 0 s" in _refusal(tiny_engine, "slow", sp)
        busy.set()
        grammars.compile(sp.json_schema).result(timeout=300)
        out, reasons = _run(tiny_engine, {"again": sp}, [1, 2])
        assert reasons["again"] in ("stop", "length")
    finally:
        busy.set()
        grammars.timeout_s = limit
