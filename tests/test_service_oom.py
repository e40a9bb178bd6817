"""Out-of-memory errors through the real server (issue 4): the worker's engine runs with
``HEADROOM_FAULTS`` (engine/faults.py), which raises ``torch.OutOfMemoryError`` at a
step's prefill on the CPU. The request ids the worker sees are the service's, so the
rules use ``*`` (any request).

- ``prefill:*:1000``: every prefill fails, so every request fails alone with
  ``out_of_memory`` (503 + Retry-After, or an error event in a stream), the engine stays
  up, and ``/api/status`` lists the request errors. The same server runs on a simulated
  card, so its status also shows the memory plan.
- ``prefill:*:1``: one transient fault; the request succeeds after the engine's retry.
"""

from __future__ import annotations

import json

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"


def chat(http, **extra):
    return http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, **extra})


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_request_that_runs_out_of_memory_fails_alone_with_503(start_server):
    server = start_server(
        ["--device-total", "3GiB", "--max-model-len", "2048"],
        {"HEADROOM_FAULTS": "prefill:*:1000"},
    )
    with server.client() as http:
        # Non-streaming: 503, Retry-After, OpenAI's error shape.
        r = chat(http)
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["code"] == "out_of_memory"
        assert error["type"] == "server_error"
        assert "out of device memory" in error["message"]

        # Streaming: an error event, then [DONE].
        r = chat(http, stream=True)
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "out_of_memory"

        # The engine stayed up: healthy, same worker, and it says what happened.
        assert server.health().status_code == 200
        status = http.get("/api/status").json()
        assert status["worker"]["restarts"] == 0
        errors = status["request_errors"]
        assert [e["code"] for e in errors] == ["out_of_memory", "out_of_memory"]
        assert all(
            e["phase"] == "prefill" and e["request_id"].startswith("chatcmpl-") for e in errors
        )
        events_seen = status["engine_events"]
        assert events_seen["oom_failed_requests"] == 2
        assert events_seen["oom_steps"] > 2  # each was retried smaller before failing
        assert events_seen["replans_wanted"] >= 1
        assert status["stats"]["failed"] == 2
        assert status["stats"]["free_pages"] == status["stats"]["total_pages"]

        # The plan of the simulated card rides in the status; the model has its own name.
        plan = status["plan"]
        assert plan is not None and plan["simulated"] is True and plan["fits"] is True
        assert "KV cache pool" in [e["name"] for e in plan["ledger"]]
        assert plan["num_pages"] + 1 == status["engine"]["num_pages"]
        assert "plan" not in status["engine"]
        assert status["engine"]["model_name"] == MODEL_NAME
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL_NAME]
    log = server.log()
    assert "out of memory in prefill for chatcmpl-" in log
    assert "wants a new memory plan" in log


def test_transient_out_of_memory_is_retried_and_succeeds(start_server):
    server = start_server(env={"HEADROOM_FAULTS": "prefill:*:1"})
    with server.client() as http:
        r = chat(http, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        status = http.get("/api/status").json()
        assert status["engine_events"]["oom_steps"] == 1
        assert status["request_errors"] == []
        assert status["plan"] is None  # a CPU run with no simulated card makes no plan
    assert server.health().status_code == 200
