"""logprobs / top_logprobs and echo through a real ``headroom serve`` with the default
model, read with the official ``openai`` client and checked against transformers'
log-softmax of the same weights."""

from __future__ import annotations

import openai
import pytest
import torch

from engine.text.chat import encode_chat
from engine.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The server runs the CPU's default, int4 weights with bfloat16 activations
# (engine/layers/linear/cpu_int4.py), against transformers' float32 reference of the
# same weights: measured 0.06 apart at most; a log-probability computed wrongly (a missing
# normalisation, another position) is off by whole units.
TOL = 0.15


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", timeout=300.0)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_logprobs_match_transformers_whole_and_streamed(client, hf, default_model_dir):
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 5
    assert choice.finish_reason == "length"
    assert "".join(t.token for t in content) == choice.message.content
    tokenizer = load_tokenizer(default_model_dir)
    prompt = encode_chat(tokenizer, QUESTION)
    ids = tokenizer.encode(choice.message.content, add_special_tokens=False)
    ref = hf_logprobs(hf, prompt + ids)
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-6
        assert abs(entry.logprob - row.max().item()) < TOL
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        values = [t.logprob for t in entry.top_logprobs]
        assert torch.allclose(torch.tensor(values), row.topk(3).values, atol=TOL)

    stream = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        stream=True,
    )
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, content, strict=True))


def test_no_logprobs_unless_asked_and_bounds(client):
    reply = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2, temperature=0)
    assert reply.choices[0].logprobs is None
    for bad in (21, -1):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="default", messages=QUESTION, max_tokens=2, logprobs=True, top_logprobs=bad
            )
        assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="Hi", max_tokens=2, logprobs=21)
    assert err.value.body["param"] == "logprobs"


def test_completion_logprobs_with_echo(client, hf, default_model_dir):
    prompt = "The capital of France is"
    reply = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    n_prompt = reply.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    tokenizer = load_tokenizer(default_model_dir)
    ids = tokenizer.encode(prompt)
    assert len(ids) == n_prompt
    ref = hf_logprobs(hf, ids)
    for p in range(1, n_prompt):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < TOL

    # Streamed without echo: the generated tokens' logprobs, the same as whole.
    whole = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    chunks = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, logprobs=1, stream=True
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens == lp.tokens[n_prompt:]
    assert "".join(tokens) == whole.choices[0].text


def _chat_tokens(client, stream: bool, **ask) -> tuple[list, str, str]:
    """(logprobs entries, content, finish_reason) of a greedy chat answer."""
    if not stream:
        choice = client.chat.completions.create(**ask).choices[0]
        return choice.logprobs.content, choice.message.content, choice.finish_reason
    entries, content, finish = [], "", None
    for chunk in client.chat.completions.create(stream=True, **ask):
        for c in chunk.choices:
            entries += c.logprobs.content if c.logprobs else []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return entries, content, finish


def _text_tokens(client, stream: bool, **ask) -> tuple[list[str], str, str]:
    """(logprobs tokens, text, finish_reason) of a greedy text completion."""
    if not stream:
        choice = client.completions.create(**ask).choices[0]
        return choice.logprobs.tokens, choice.text, choice.finish_reason
    tokens, text, finish = [], "", None
    for chunk in client.completions.create(stream=True, **ask):
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
            text += c.text
            finish = c.finish_reason or finish
    return tokens, text, finish


def _stops(tokens: list[str], text: str) -> dict[str, tuple[str, str]]:
    """Stop strings cut into a greedy answer's tokens: ``boundary`` begins exactly where
    a token begins, ``mid_token`` one character into a token of three or more; each
    with the content it leaves (the text before its first occurrence) and the text of
    the token the content ends with."""
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    found = {}
    for i in range(2, len(tokens) - 1):
        if not text.startswith("".join(tokens[: i + 2])):
            break  # past the text the tokens spell (an end token's text)
        for kind, skip in (("boundary", 0), ("mid_token", 1)):
            if kind in found or (skip and len(tokens[i].strip()) < 3):
                continue
            stop = (tokens[i] + tokens[i + 1])[skip:]
            at = text.find(stop)
            if at == starts[i] + skip:  # its first occurrence is the one chosen
                found[kind] = (stop, text[:at], tokens[i][:skip] or tokens[i - 1])
    assert set(found) == {"boundary", "mid_token"}, (tokens, found)
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_spell_the_content_cut_by_a_stop_string(client, stream):
    """With a stop string the logprobs' tokens spell the returned text exactly: none
    of the stop's tokens, and a token the stop begins inside keeps its part before it
    (its logprob the whole token's), chat and text completions alike."""
    chat = {"model": "default", "messages": QUESTION, "max_tokens": 16, "temperature": 0,
            "logprobs": True}
    entries, content, _ = _chat_tokens(client, False, **chat)
    for kind, (stop, before, last) in _stops([e.token for e in entries], content).items():
        got, text, finish = _chat_tokens(client, stream, stop=[stop], **chat)
        assert (text, finish) == (before, "stop"), kind
        assert "".join(e.token for e in got) == text, (kind, [e.token for e in got])
        assert got[-1].token == last and bytes(got[-1].bytes).decode() == last, kind
        assert got[-1].logprob == pytest.approx(entries[len(got) - 1].logprob, abs=1e-5), kind
    prompt = "The capital of France is"
    legacy = {"model": "default", "prompt": prompt, "max_tokens": 16, "temperature": 0,
              "logprobs": 1}
    tokens, full, _ = _text_tokens(client, False, **legacy)
    for kind, (stop, before, last) in _stops(tokens, full).items():
        got, text, finish = _text_tokens(client, stream, stop=[stop], **legacy)
        assert (text, finish) == (before, "stop"), kind
        assert "".join(got) == text and got[-1] == last, (kind, got)


def test_prompt_scoring_with_max_tokens_0(client):
    """``echo`` + ``logprobs`` + ``max_tokens: 0`` scores the prompt (as lm-eval style
    clients do): the prompt's tokens and logprobs, as with ``max_tokens: 1`` less the
    generated token; whole, streamed, and for each of ``n`` choices."""
    prompt = "Once upon a time"
    ask = dict(model="default", prompt=prompt, temperature=0, logprobs=2, echo=True)
    one = client.completions.create(max_tokens=1, **ask).choices[0].logprobs
    n_prompt = len(one.tokens) - 1
    reply = client.completions.create(max_tokens=0, n=2, **ask)
    assert len(reply.choices) == 2
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == n_prompt
    for choice in reply.choices:
        lp = choice.logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert lp.tokens == one.tokens[:n_prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        pairs = zip(lp.token_logprobs[1:], one.token_logprobs[1:n_prompt], strict=True)
        assert all(abs(a - b) < 1e-5 for a, b in pairs)
        assert [set(t) for t in lp.top_logprobs[1:]] == [set(t) for t in one.top_logprobs[1:n_prompt]]
        assert lp.text_offset == one.text_offset[:n_prompt]

    chunks = list(client.completions.create(max_tokens=0, stream=True, **ask))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == prompt
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == one.tokens[:n_prompt]
    assert streamed[-1].finish_reason == "length"
