"""The OpenAI API of a real ``headroom serve`` with the default model: the official
client and plain HTTP, streaming and not, and 32 concurrent streams."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def sse_events(lines) -> list:
    """Parse ``data:`` lines until ``[DONE]``; returns the JSON events, then "DONE"."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            events.append("DONE")
            break
        events.append(json.loads(data))
    return events


def test_openai_client_chat(real_server):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply.choices[0].message.content


def test_openai_client_retrieves_a_model_by_any_name_it_lists(real_server):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused")
    listed = client.models.list().data
    for card in listed:
        got = client.models.retrieve(card.id)
        assert (got.id, got.object) == (card.id, "model")
        assert got.context_length == card.context_length
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    assert raised.value.body["code"] == "model_not_found"
    assert listed[0].id in raised.value.body["message"]


def test_the_names_api_tags_lists_work_on_v1_as_on_api(real_server):
    """A client that found the model in Ollama's /api/tags (``name:latest``) calls /v1
    with that name; names compare as Ollama compares them on every API (case-blind,
    ``name`` the same as ``name:latest``), another tag is another model. A retrieve by
    such a name answers with the name as /v1/models lists it (it echoed ``DEFAULT``, an
    id no listing has), Anthropic's shape too."""
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0)
    tagged = httpx.get(real_server.base_url + "/api/tags", timeout=30).json()["models"][0]["name"]
    assert tagged.endswith(":latest")
    listed = [card.id for card in client.models.list().data]
    for name, listed_as in ((tagged, listed[0]), (tagged.upper(), listed[0]), ("default:latest", "default"),
                            ("DEFAULT", "default"), ("default:", "default")):
        reply = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=2, temperature=0)
        assert reply.choices[0].message.content is not None, name
        got = client.models.retrieve(name)
        assert (got.object, got.id) == ("model", listed_as), name
        anthropic_card = httpx.get(f"{real_server.base_url}/v1/models/{name}", timeout=30,
                                   headers={"anthropic-version": "2023-06-01"}).json()
        assert anthropic_card["id"] == listed_as, anthropic_card
    answer = httpx.post(real_server.base_url + "/v1/messages", timeout=120, json={
        "model": tagged, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200, answer.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=tagged.replace(":latest", ":q4"), messages=QUESTION, max_tokens=2)


def test_an_empty_content_array_is_refused_as_openai_refuses_it(real_server):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": []}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="default", messages=turns, max_tokens=2)
    assert raised.value.body["param"] == "messages[1].content"
    assert "empty array" in raised.value.body["message"]
    # An empty string is a turn that says nothing: taken, as OpenAI takes it.
    turns[1]["content"] = ""
    assert client.chat.completions.create(model="default", messages=turns, max_tokens=2).choices


def test_openai_client_completions(real_server):
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused")
    reply = client.completions.create(
        model="", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert reply.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == reply.choices[0].text


def test_plain_http_chat_and_models(real_server):
    with real_server.client() as http:
        models = http.get("/v1/models").json()
        card = models["data"][0]
        assert card["object"] == "model"
        assert 0 < card["context_length"] <= card["model_context_length"]
        r = http.post(
            "/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert "Paris" in body["choices"][0]["message"]["content"]
        # The README's quick start names the model "default".
        r = http.post(
            "/v1/chat/completions",
            json={"model": "default", "messages": QUESTION, "max_tokens": 2, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == card["id"]


def test_n_choices_stop_and_seed(real_server):
    with real_server.client() as http:
        body = {
            "messages": [{"role": "user", "content": "Tell me a short story."}],
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 7,
            "n": 3,
        }
        a = http.post("/v1/chat/completions", json=body).json()
        b = http.post("/v1/chat/completions", json=body).json()
        assert [c["index"] for c in a["choices"]] == [0, 1, 2]
        assert [c["message"]["content"] for c in a["choices"]] == [
            c["message"]["content"] for c in b["choices"]
        ]
        # One prompt, counted once; three completions of at most 12 tokens each.
        assert 3 <= a["usage"]["completion_tokens"] <= 36
        # Seeds differ per choice (seed + index), so the choices are not copies.
        assert len({c["message"]["content"] for c in a["choices"]}) > 1

        greedy = http.post(
            "/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 16, "temperature": 0},
        ).json()["choices"][0]["message"]["content"]
        assert "Paris" in greedy
        cut = http.post(
            "/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 16, "temperature": 0, "stop": ["Paris"]},
        ).json()["choices"][0]
        assert cut["finish_reason"] == "stop"
        assert cut["message"]["content"] == greedy.split("Paris")[0]


PROMPTS = [
    f"Write one sentence about the number {i} and the color {color}."
    for i, color in enumerate(
        ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"] * 4
    )
]


def test_32_concurrent_streams_match_greedy_alone(start_server):
    # Float32 weights: the CPU's default int4 path computes with bfloat16 activations, where
    # the attention's padded batch rounds a sequence's hidden state differently from the
    # sequence alone and flips near-tied tokens now and then; float32 keeps the check
    # exact, and it is the batching (no answer mixed with another) that is under test.
    # Pages of 8 tokens: each answer's 8 tokens cross a page boundary while the 32 decode
    # together (a page taken in a batch), where a mix-up of pages would show.
    real_server = start_server(["--num-pages", "512", "--page-size", "8", "--no-gguf-quantized"])
    max_tokens = 8  # enough for a mixed-up answer to show; each is decoded twice

    def body(prompt: str, stream: bool) -> dict:
        return {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }

    # A busy 2-core machine may take minutes over the 32 requests one by one.
    with real_server.client(timeout=300.0) as http:
        alone = [
            http.post("/v1/chat/completions", json=body(p, False)).json()["choices"][0]["message"][
                "content"
            ]
            for p in PROMPTS
        ]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        async with client.stream("POST", "/v1/chat/completions", json=body(prompt, True)) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "DONE"
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])

    async def all_at_once() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=real_server.base_url, timeout=300.0, limits=limits
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert len(set(alone)) >= 24, alone  # answers that differ, so a mix-up would show
    together = asyncio.run(all_at_once())
    assert len(together) == 32
    for prompt, a, b in zip(PROMPTS, alone, together, strict=True):
        assert a, prompt
        assert a == b, prompt
