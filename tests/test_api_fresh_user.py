"""What a fresh user of the APIs met, each through a real ``headroom serve`` on the
embedded default model (or a tiny random model without a chat template): a served
name ending in ``:latest`` that Ollama's routes did not take as /api/tags lists it
(nor ``gpt-4:``, an empty tag); chat and text completion logprobs with an entry for
the end token, which is not in the text (with ``ignore_eos`` too); ``stream_options`` taken on a call that does not stream; a boolean JSON
schema refused with a misleading message; Ollama's /api/generate refused on a model
without a chat template, whose chat refusals named /v1/completions alone (and
``headroom generate``'s exit 1); /api/show's parameters under headroom's field names, not
Ollama's; a corrupt GGUF's numpy warnings on stderr and an invalid_logits error in the
engine's words."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from service_harness import ServerProcess, serving, tiny_model_server

SERVED = "gpt-4:latest"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    yield from serving(ServerProcess(tmp_path_factory.mktemp("fresh-user"), ["--served-model-name", SERVED]))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


def _ollama_calls(model: str) -> dict[str, dict]:
    short = {"stream": False, "options": {"num_predict": 1}}
    return {
        "/api/chat": {"model": model, "messages": HI, **short},
        "/api/generate": {"model": model, "prompt": "Hi", **short},
        "/api/show": {"model": model},
    }


def test_every_name_the_listings_give_works_in_ollamas_calls(http):
    tags = [m["name"] for m in http.get("/api/tags").json()["models"]]
    listed = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert tags == [SERVED] and SERVED in listed, (tags, listed)
    # As Ollama: the name listed, without its tag :latest or with an empty tag, and in any case.
    for model in (SERVED, "gpt-4", "gpt-4:", "GPT-4", "Gpt-4:LATEST", "default"):
        for path, body in _ollama_calls(model).items():
            r = http.post(path, json=body)
            assert r.status_code == 200, (path, model, r.text)
            if path != "/api/show":
                assert r.json()["model"] == SERVED, r.json()
        r = http.post("/api/chat", json={"model": model, "messages": []})
        assert r.status_code == 200 and r.json()["done_reason"] == "load", (model, r.text)


def test_show_names_the_parameters_as_ollamas_modelfile_does(http):
    r = http.post("/api/show", json={"model": SERVED})
    assert r.status_code == 200, r.text
    names = [line.split()[0] for line in r.json()["parameters"].splitlines()]
    assert names == ["temperature", "top_p", "top_k", "min_p", "repeat_penalty"], names


def test_a_name_with_a_second_tag_is_another_model(http):
    for path, body in _ollama_calls(SERVED + ":latest").items():
        r = http.post(path, json=body)
        assert r.status_code == 404, (path, r.text)
        assert "gpt-4:latest" in r.json()["error"], r.text
    r = http.post("/api/chat", json={"model": "gpt-4:q4", "messages": HI, "stream": False})
    assert r.status_code == 404, r.text


def _chat_logprobs(http, stream: bool, **body) -> tuple[list[str], str, str]:
    """(logprobs tokens, content, finish_reason) of a greedy chat answer."""
    body = {"messages": HI, "max_tokens": 200, "temperature": 0, "logprobs": True, "stream": stream, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return [t["token"] for t in choice["logprobs"]["content"]], choice["message"]["content"], choice["finish_reason"]
    tokens, content, finish = [], "", ""
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            tokens += [t["token"] for t in (choice.get("logprobs") or {}).get("content") or []]
            content += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return tokens, content, finish


SCHEMA = {"type": "json_schema", "json_schema": {"name": "hi", "schema": {
    "type": "object", "properties": {"greeting": {"type": "string", "maxLength": 12}},
    "required": ["greeting"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("structured", [False, True])
def test_logprobs_spell_an_answer_that_ended_on_its_end_token(http, stream, structured):
    extra = {"response_format": SCHEMA} if structured else {}
    tokens, content, finish = _chat_logprobs(http, stream, **extra)
    assert finish == "stop", (finish, content)
    assert "<|im_end|>" not in tokens and "".join(tokens) == content, (tokens, content)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_spell_an_answer_that_ignored_its_end_token(http, stream):
    """With ignore_eos the answer goes on past <|im_end|>, which the text skips (a special
    token); its logprobs entry was kept, so the tokens no longer spelled the text."""
    ended, _, _ = _chat_logprobs(http, stream)
    tokens, content, finish = _chat_logprobs(http, stream, ignore_eos=True, max_tokens=len(ended) + 12)
    assert finish == "length", (finish, content)
    assert "<|im_end|>" not in tokens and "".join(tokens) == content, (tokens, content)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_spell_the_text_without_the_end_token(http, stream):
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "logprobs": 1, "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(x[len("data: "):]) for x in r.text.splitlines() if x.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
    else:
        choices = r.json()["choices"]
    tokens = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    text = "".join(c["text"] for c in choices)
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["stop"], choices[-1]
    assert "<|im_end|>" not in tokens and "".join(tokens) == text, (tokens, text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_without_stream_is_refused_as_openai_refuses_it(http, path):
    body = {"messages": HI} if "chat" in path else {"prompt": "Hi"}
    for stream in ({}, {"stream": False}):
        r = http.post(path, json={**body, "max_tokens": 1, "stream_options": {"include_usage": True}, **stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stream_options" and error["type"] == "invalid_request_error", error
        assert '"stream": true' in error["message"], error
    r = http.post(path, json={**body, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage":{' in r.text.replace(" ", ""), r.text


def _with_schema(schema) -> dict:
    return {"messages": [{"role": "user", "content": "Give me a JSON value."}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}}


def test_a_boolean_schema_is_json_schemas(http):
    r = http.post("/v1/chat/completions", json=_with_schema(True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a whole value (else cut by max_tokens)
        json.loads(choice["message"]["content"])
    r = http.post("/v1/chat/completions", json=_with_schema(False))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "schema is false, which no value matches" in error["message"], error
    assert "send a schema object, or true" in error["message"], error


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer):
    """A tiny random Qwen3 whose tokenizer has no chat template, served: (hf, server)."""
    tokenizer = copy.deepcopy(smollm_tokenizer)
    tokenizer.chat_template = None
    with tiny_model_server(tmp_path_factory, make_tiny_hf_model, tokenizer, "qwen3") as served:
        yield served


def _greedy_text(hf, tokenizer, text: str, steps: int) -> str:
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_on_a_model_without_a_chat_template_passes_the_prompt_through(untemplated, smollm_tokenizer):
    hf, server = untemplated
    ask = {"model": "default", "prompt": "The capital of France", "stream": False,
           "options": {"num_predict": 6, "temperature": 0}}
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        plain = http.post("/api/generate", json=ask)
        with_system = http.post("/api/generate", json={**ask, "system": "Answer briefly."})
        raw = http.post("/api/generate", json={**ask, "system": "Answer briefly.", "raw": True})
        chat = http.post("/api/chat", json={"model": "default", "messages": HI, "stream": False})
    for r in (plain, with_system, raw):
        assert r.status_code == 200, r.text
    assert plain.json()["response"] == _greedy_text(hf, smollm_tokenizer, "The capital of France", 6)
    assert with_system.json()["response"] == _greedy_text(hf, smollm_tokenizer, "Answer briefly.\n\nThe capital of France", 6)
    assert raw.json()["response"] == plain.json()["response"]  # raw: the prompt alone
    assert chat.status_code == 400 and "use /api/generate" in chat.json()["error"], chat.text


def test_chat_calls_on_a_model_without_a_chat_template_name_the_raw_calls(untemplated):
    """The refusals said "use /v1/completions"; Ollama's /api/generate takes such a model's
    prompt as is too, so each names both."""
    _, server = untemplated
    calls = {"/v1/chat/completions": {"model": "default", "messages": HI, "max_tokens": 2},
             "/v1/messages": {"model": "default", "messages": HI, "max_tokens": 2},
             "/v1/responses": {"model": "default", "input": "Say hi.", "max_output_tokens": 2}}
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        for path, body in calls.items():
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert ("this model's tokenizer has no chat template, so it cannot render messages: use "
                    "/v1/completions or /api/generate, which take a raw prompt") in r.json()["error"]["message"], r.text


def test_generate_through_the_service_on_a_model_without_a_chat_template_names_raw(untemplated):
    """headroom generate answered by the running service said the API's refusal (naming
    /v1/completions) with exit 1; like the in-process one it is a usage error naming --raw."""
    import os

    from click.testing import CliRunner

    from service.cli.commands import main

    _, server = untemplated
    env = {"HEADROOM_RUNTIME_DIR": str(server.log_path.parent / "runtime"), "HEADROOM_CONFIG": os.devnull}
    result = CliRunner().invoke(main, ["generate", "--max-tokens", "2", "hi"], env=env)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("headroom: error: this model's tokenizer has no chat template, so it cannot "
                                     "render messages; pass --raw to send the prompt as it is"), result.stderr
    raw = CliRunner().invoke(main, ["generate", "--raw", "--max-tokens", "2", "hi"], env=env)
    assert raw.exit_code == 0 and "error" not in raw.output, raw.output


def _corrupt_gguf(path, make_tiny_hf_model) -> None:
    """A tiny Qwen3 GGUF whose embedding's Q8_0 blocks all have an infinite scale."""
    import gguf
    import numpy as np
    from test_gguf_convert import VOCAB, write_gguf

    hf = make_tiny_hf_model("qwen3", None, vocab_size=VOCAB)
    q = gguf.quantize(hf.model.embed_tokens.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
    blocks = q.reshape(-1, 34).copy()  # a Q8_0 block: its float16 scale, then 32 int8 values
    blocks[:, :2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    override = {"token_embd.weight": (blocks.reshape(q.shape), gguf.GGMLQuantizationType.Q8_0)}
    write_gguf(path, "qwen3", hf, override=override)


def test_a_corrupt_gguf_is_said_once_and_its_requests_fail_in_a_user_s_words(tmp_path, start_server,
                                                                            make_tiny_hf_model):
    path = tmp_path / "corrupt.gguf"
    _corrupt_gguf(path, make_tiny_hf_model)
    server = start_server(["--model", str(path)])
    with server.client(timeout=300) as http:
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_logits", error
    assert error["message"].startswith("the model produced NaN or infinite logits for this request"), error
    assert "the model file may be corrupt" in error["message"], error
    for internal in ("batch rows", "sample the others", "penalties"):
        assert internal not in error["message"], error
    log = server.log()
    assert "RuntimeWarning" not in log, log
    said = [line for line in log.splitlines() if "holds NaN or infinite values" in line]
    assert len(said) == 1 and "token_embd.weight" in said[0], said
