"""Out-of-memory errors through the real server (issue 4): the worker's engine runs with
``HEADROOM_FAULTS`` (engine/common/faults.py), which raises ``torch.OutOfMemoryError`` at a
step's prefill on the CPU. The request ids the worker sees are the service's, so the
rules use ``*`` (any request).

- ``prefill:*:1000``: every prefill fails, so every request fails alone with
  ``out_of_memory`` (503 + Retry-After, or an error event in a stream), the engine stays
  up, and ``/api/status`` (the event hub's snapshot) lists the request errors. The same server runs on a simulated
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
        assert status["type"] == "snapshot"
        assert status["health"]["restarts"] == 0
        # Every out-of-memory step is a request_error with the action taken; two
        # requests failed, each after being retried with smaller chunks.
        errors = status["request_errors"]
        assert all(e["code"] == "out_of_memory" for e in errors)
        assert all(
            e["phase"] == "prefill" and e["request_id"].startswith("chatcmpl-") for e in errors
        )
        assert [e["action"] for e in errors].count("failed") == 2
        assert "retry_smaller_chunk" in [e["action"] for e in errors]
        counters = status["counters"]
        assert counters["oom_failed_requests"] == 2
        assert counters["oom_steps"] > 2  # each was retried smaller before failing
        assert counters["replans"] >= 1
        assert status["replans"][0]["action"] == "lower_chunk_cap"
        stats = counters["engine"]
        assert stats["failed"] == 2
        assert stats["free_pages"] == stats["total_pages"]

        # The plan of the simulated card rides in the status; the model has its own name.
        plan = status["plan"]["plan"]
        assert plan is not None and plan["simulated"] is True and plan["fits"] is True
        assert "KV cache pool" in [e["name"] for e in plan["ledger"]]
        engine = status["engine"]["info"]
        assert plan["num_pages"] == engine["num_pages"] == stats["total_pages"]  # usable pages, one count
        assert engine["plan"] is None
        assert engine["model_name"] == MODEL_NAME
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL_NAME, "default"]
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
        assert status["counters"]["oom_steps"] == 1
        (error,) = status["request_errors"]  # the step that failed, and what was done
        assert error["code"] == "out_of_memory" and error["action"] != "failed"
        assert status["plan"]["plan"] is None  # a CPU run with no simulated card: no plan
        vram = status["vram"]  # NVML's view; without an NVIDIA GPU, CPU mode and why
        assert vram["source"] in ("nvml", "none"), vram
        if vram["source"] == "none":
            assert "no GPU, CPU mode" in vram["reason"] and vram["total_bytes"] == 0
    assert server.health().status_code == 200
