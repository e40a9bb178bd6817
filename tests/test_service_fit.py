"""A tight card, end to end with a real ``headroom serve`` on the CPU: a simulated 4 GiB
card with 1 GiB held by another app at start. The service starts with the largest
context that fits above ``--min-context`` (instead of refusing), says so in the log,
``/api/status`` and ``/v1/models``, refuses a prompt longer than that context at once,
and when the other app leaves the context grows back with the KV pool.
"""

from __future__ import annotations

import json

import pytest
from service_harness import wait_for

pytestmark = pytest.mark.slow

GiB = 1 << 30


def test_a_tight_card_starts_with_a_lowered_context_that_grows_back(start_server, tmp_path):
    timeline, leave = tmp_path / "timeline.json", tmp_path / "leave"
    # The steps are all of the other processes: the 1 GiB --device-free left out at start
    # is theirs, and they let go of it when the test makes the file "leave" (after the
    # lowered context was checked, however slow the machine).
    timeline.write_text(json.dumps({"start": f"file:{leave}", "baseline": "replaced", "steps": [[0, 0]]}))
    # A 1 GiB desktop reserve: with the default model's weights in float32 on the CPU
    # (--no-gguf-quantized: the int4 repacking would leave room for it all), the 4 GiB
    # card's budget then holds a little less than the model's 8192-token context.
    flags = ("--device-total 4GiB --device-free 3GiB --reserve 1GiB --vram-source simulated --replan-hold 1 "
             "--no-gguf-quantized")
    server = start_server([*flags.split(), "--vram-timeline", str(timeline)])
    http = server.client()

    model = http.get("/v1/models").json()["data"][0]
    lowered = model["context_length"]
    assert 2048 <= lowered < 8192, model
    assert model["model_context_length"] == 8192
    assert lowered % 16 == 0  # lowered by whole pages

    # A prompt longer than the lowered context (but within the model's): 400 at once.
    too_long = http.post(
        "/v1/completions",
        json={"prompt": "hello " * (lowered + 100), "max_tokens": 1},
    )
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["code"] == "context_length_exceeded"

    status = http.get("/api/status").json()
    plan = status["plan"]["plan"]
    assert plan["fits"] and plan["max_context_tokens"] == lowered
    assert plan["wanted_context_tokens"] == 8192
    note = plan["context_note"]
    assert note == f"context 8,192 -> {lowered:,} tokens: 1.00 GiB held by other processes", note
    assert note in server.log()
    # Still before the app leaves: the context seen above was the lowered one.
    others = status["vram"]["others_bytes"] if status["vram"] else GiB
    assert others >= GiB - (1 << 20), "the other app left before the lowered context was checked"

    # The other app leaves: the pool grows, and the context with it, to the model's.
    leave.touch()
    grown = wait_for(
        lambda: (m := http.get("/v1/models").json()["data"][0])["context_length"] == 8192 and m,
        180,
        "the context to grow back to 8192 tokens",
    )
    assert grown["max_model_len"] == 8192
    final = http.get("/api/status").json()
    assert "grow_kv" in [r["action"] for r in final["replans"]]
    assert final["engine"]["info"]["max_context_tokens"] == 8192
    http.close()
