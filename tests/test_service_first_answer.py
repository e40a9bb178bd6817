"""A new user's first request against a real ``headroom serve`` with the default model:
the README's own curl body, no sampling fields and no max_tokens, answers in a sentence
and stops by itself; /v1/models lists every name the model answers to."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).parent.parent / "README.md"


def readme_chat_body() -> dict:
    """The JSON body of the README's first curl example."""
    match = re.search(r"/v1/chat/completions .*?-d '(\{.*?\})'", README.read_text(), re.S)
    assert match, "the README has no chat curl example"
    return json.loads(match.group(1))


def test_readme_example_answers_and_stops(real_server):
    body = readme_chat_body()
    assert "temperature" not in body and "max_tokens" not in body
    with real_server.client(timeout=600.0) as http:
        for seed in range(3):
            r = http.post("/v1/chat/completions", json={**body, "seed": seed})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            # The model's card sampling (temperature 0.2): on topic, and it ends.
            assert "GPU" in choice["message"]["content"], choice
            assert choice["finish_reason"] == "stop", choice


def test_models_lists_every_name(real_server):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused")
    names = [m.id for m in client.models.list().data]
    assert names[-1] == "default" and len(names) == len(set(names)) >= 2
    for name in names:
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
        assert reply.model == names[0]


def test_logit_bias_through_the_openai_client(real_server, smollm_tokenizer):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", timeout=300)
    ask = {"model": "default", "prompt": "The capital of France is", "max_tokens": 1}
    first = client.completions.create(temperature=0, **ask).choices[0].text
    greedy = smollm_tokenizer.encode(first, add_special_tokens=False)[0]
    banned = (
        client.completions.create(temperature=0, logit_bias={str(greedy): -100}, **ask)
        .choices[0]
        .text
    )
    assert banned and banned != first
    forced = client.completions.create(logit_bias={str(greedy): 100}, **ask).choices[0].text
    assert forced == first  # sampled at temperature 0.2, yet +100 wins every draw
    for bias, why in (({"999999999": -100}, "outside"), ({"5": 300}, "[-100, 100]")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(logit_bias=bias, **ask)
        assert exc.value.body["param"] == "logit_bias" and why in exc.value.body["message"]
