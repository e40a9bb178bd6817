"""Ollama's API of a real ``headroom serve``: the official ``ollama`` Python client with
the default model (chat, streams, generate, tags, show, ps, version, errors), and with
the fake engine the API key and a worker killed under a stream."""

from __future__ import annotations

import json
import os
import signal

import httpx
import ollama
import pytest
from service_harness import wait_for

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 16}


def test_ollama_client_chat_and_stream(real_server):
    client = ollama.Client(host=real_server.base_url, timeout=600)
    # One entry for the one model (tagged as Ollama tags it), though "default" and its
    # other names answer too.
    (listed,) = client.list().models
    assert listed.model.endswith(":latest") and listed.model != "default:latest", listed
    assert [m.model for m in client.ps().models] == [listed.model]
    assert client.chat(model=listed.model, messages=QUESTION, options=GREEDY, stream=False).done
    reply = client.chat(model="default", messages=QUESTION, options=GREEDY, stream=False)
    assert "Paris" in reply.message.content
    assert reply.message.role == "assistant"
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.eval_count > 0 and reply.prompt_eval_count > 0
    assert reply.total_duration >= reply.eval_duration > 0
    assert reply.model == listed.model  # the name every alias answers with, as /api/tags lists it

    parts = list(
        client.chat(model="default:latest", messages=QUESTION, options=GREEDY, stream=True)
    )
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].eval_count == reply.eval_count
    assert "".join(p.message.content for p in parts) == reply.message.content

    # num_predict caps the answer; seeds repeat.
    short = client.chat(
        model="default", messages=QUESTION, options={"num_predict": 2, "seed": 3}, stream=False
    )
    assert short.eval_count == 2 and short.done_reason == "length"
    again = client.chat(
        model="default", messages=QUESTION, options={"num_predict": 2, "seed": 3}, stream=False
    )
    assert again.message.content == short.message.content


def test_ollama_client_generate(real_server):
    client = ollama.Client(host=real_server.base_url, timeout=600)
    templated = client.generate(model="default", prompt=QUESTION[0]["content"], options=GREEDY)
    assert "Paris" in templated.response and templated.done
    raw = client.generate(
        model="default", prompt="The capital of France is", raw=True, options=GREEDY
    )
    assert raw.response and raw.prompt_eval_count < templated.prompt_eval_count
    streamed = "".join(
        p.response
        for p in client.generate(
            model="default",
            prompt="The capital of France is",
            raw=True,
            options=GREEDY,
            stream=True,
        )
    )
    assert streamed == raw.response
    loaded = client.generate(model="default")  # empty prompt: is the model loaded?
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_ollama_logprobs_whole_and_streamed(real_server):
    """Ollama's ``logprobs`` and ``top_logprobs`` (the official client sends them) were
    dropped unsaid: no ``logprobs`` in the answer. Now each answer (and each stream line,
    for the tokens its text carries) has them, spelling the text, as /v1 gives them."""
    client = ollama.Client(host=real_server.base_url, timeout=600)
    for call in (lambda **kw: client.chat(model="default", messages=QUESTION, **kw),
                 lambda **kw: client.generate(model="default", prompt=QUESTION[0]["content"], **kw)):
        whole = call(options=GREEDY, logprobs=True, top_logprobs=2)
        text = whole.message.content if hasattr(whole, "message") else whole.response
        assert text and "".join(lp.token for lp in whole.logprobs) == text
        assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in whole.logprobs)
        parts = list(call(options=GREEDY, logprobs=True, stream=True))
        assert [lp.token for p in parts for lp in p.logprobs or []] == [lp.token for lp in whole.logprobs]
        assert call(options=GREEDY).logprobs is None  # only when asked
    with pytest.raises(ollama.ResponseError) as many:
        client.chat(model="default", messages=QUESTION, logprobs=True, top_logprobs=21)
    assert many.value.status_code == 400 and "top_logprobs" in many.value.error


def test_ollama_client_show_ps_version(real_server):
    client = ollama.Client(host=real_server.base_url, timeout=60)
    shown = client.show("default")
    assert shown.details.family == "llama"
    # The CPU serves the GGUF's Q4_1 weights repacked, not float32: as Ollama names them.
    assert shown.details.parameter_size == "135M"
    assert (shown.details.format, shown.details.quantization_level) == ("gguf", "Q4_1")
    listed = client.list().models[0].details
    assert (listed.parameter_size, listed.quantization_level) == ("135M", "Q4_1")
    assert "temperature 0.2" in shown.parameters  # the default model's card sampling
    assert "im_start" in shown.template
    assert "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] > 0
    running = client.ps().models
    assert running and running[0].context_length > 0 and running[0].size > 0
    assert httpx.get(real_server.base_url + "/api/version").json()["version"]


def test_ollama_errors(real_server):
    client = ollama.Client(host=real_server.base_url, timeout=60)
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=QUESTION)
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    with pytest.raises(ollama.ResponseError) as hot:
        client.chat(model="default", messages=QUESTION, options={"temperature": 5})
    assert hot.value.status_code == 400 and "temperature" in hot.value.error
    r = httpx.post(
        real_server.base_url + "/api/chat",
        json={"model": "default", "messages": QUESTION, "format": "yaml"},
    )
    assert r.status_code == 400 and "format" in r.json()["error"]
    # Ollama's error shape, not OpenAI's, for bodies the decoder refuses too.
    r = httpx.post(real_server.base_url + "/api/chat", content=b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    # No messages is Ollama's load call, not an error (tests/test_api_ollama_loading.py).
    r = httpx.post(real_server.base_url + "/api/chat", json={"model": "default", "messages": []})
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    # /api/show names its model too, as Ollama requires (not the served one by default).
    for body in ({}, {"model": ""}, {"name": ""}):
        r = httpx.post(real_server.base_url + "/api/show", json=body)
        assert (r.status_code, r.json()) == (400, {"error": "model is required"}), body


def test_images_are_refused_naming_the_field(real_server):
    """``images`` (this server serves text models) was refused without naming the field
    on /api/chat ("images are not supported") and in other words on /api/generate
    ("images is not supported by this server"): both name it, as Ollama's error shape
    (no ``param``) needs, in the same words."""
    client = ollama.Client(host=real_server.base_url, timeout=60)
    png = b"\x89PNG\r\n\x1a\n"
    ask = [*QUESTION, {"role": "user", "content": "What is in it?", "images": [png]}]
    with pytest.raises(ollama.ResponseError) as chat:
        client.chat(model="default", messages=ask)
    with pytest.raises(ollama.ResponseError) as generate:
        client.generate(model="default", prompt="What is in it?", images=[png])
    words = "is not supported: this server serves text models, which take no images; send the text alone"
    assert (chat.value.status_code, chat.value.error) == (400, f"messages[1].images {words}")
    assert (generate.value.status_code, generate.value.error) == (400, f"images {words}")
    r = httpx.post(real_server.base_url + "/api/generate", json={"model": "default", "prompt": "Hi", "images": ["x"]})
    assert r.status_code == 400 and r.json() == {"error": f"images {words}"}


def test_tool_call_arguments_as_text_are_refused_as_ollama_refuses_them(real_server):
    """Ollama takes a tool call's arguments as an object; JSON text (OpenAI's form) is a
    400 naming the field, where it was taken."""
    call = {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}, *QUESTION]
    r = httpx.post(real_server.base_url + "/api/chat", json={"model": "default", "messages": turns}, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert "messages[1].tool_calls[0].function.arguments must be an object" in message and "not str" in message
    # The ollama client sends them as an object: taken, and then refused only as calls
    # this model's template has no tool support for (it would leave them out of the prompt).
    call["function"]["arguments"] = {"city": "Paris"}
    client = ollama.Client(host=real_server.base_url, timeout=300)
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="default", messages=turns, options={"num_predict": 2})
    assert exc.value.status_code == 400 and exc.value.error.startswith("messages[1].tool_calls cannot be sent")


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": 5, "arguments": {}}}]}, {"role": "tool", "content": "sunny"}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [*QUESTION, {"role": "tool", "content": "sunny", "tool_name": 5}]}, "messages[1].tool_name"),
])
def test_a_tool_name_of_the_wrong_json_type_is_refused_naming_it(real_server, body, field):
    """A tool's name, a past call's or a tool result's ``tool_name`` that is no string
    is a 400 whose message starts with the field (Ollama's ``{"error": message}`` has
    no param), as Ollama refuses a number where it reads a string; a past call's name
    of 5 reached the template, and a ``tool_name`` of 5 was dropped unsaid."""
    r = httpx.post(real_server.base_url + "/api/chat", json={"model": "default", "messages": QUESTION, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(f"{field} must be a string, got number"), r.text


def test_ollama_api_key_and_worker_killed_mid_stream(start_server):
    server = start_server(["--api-key", "sekrit"], {"HEADROOM_FAKE_STEP_S": "0.2"}, fake=True)
    body = {"model": "default", "messages": QUESTION, "options": {"num_predict": 500}}
    r = httpx.post(server.base_url + "/api/chat", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    assert httpx.get(server.base_url + "/api/tags").status_code == 401
    client = ollama.Client(host=server.base_url, headers={"Authorization": "Bearer sekrit"})
    assert client.list().models

    headers = {"Authorization": "Bearer sekrit"}
    lines = []
    with httpx.stream(
        "POST", server.base_url + "/api/chat", json=body, headers=headers, timeout=120
    ) as stream:
        killed = False
        for line in stream.iter_lines():
            if not line:
                continue
            lines.append(json.loads(line))
            if not killed:
                os.kill(server.worker_pid(), signal.SIGKILL)
                killed = True
    # As on /v1: a stream with tokens already out ends with the error, never hangs.
    assert "error" in lines[-1] and "restart" in lines[-1]["error"], lines[-1]
    wait_for(lambda: server.health().status_code == 200, 60, "ready again")
    after = client.chat(model="default", messages=QUESTION, options={"num_predict": 3})
    assert after.done and after.eval_count == 3
