"""A streamed ``/v1/responses`` answer cut before the engine finished, through a real
``headroom serve`` (default model) and the official ``openai`` client's stream parsing:
the item being written closes with the text that was streamed, ``status:
"incomplete"``, in its ``response.output_item.done`` and in the final response.

The cuts are forced, not raced: once the first text delta has arrived, a fault file
dropped in ``HEADROOM_FAULTS_DIR`` (engine/common/faults.py) makes the next step slower
than what is left of ``--request-timeout`` (the timeout), or makes every step run out
of memory (an engine error after the stream began). ``ignore_eos`` keeps the answer
going until then.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from service_harness import ServerProcess, serving, wait_for

pytestmark = pytest.mark.slow

TIMEOUT_S = 6  # the stream is cut after its first delta, which comes within a second
LONG = {
    "input": "Tell me a long story.",
    "max_output_tokens": 3000,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture(scope="module")
def cut_server(tmp_path_factory, default_model_dir) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("cut")
    (tmp / "faults").mkdir()
    args = ["--num-pages", "512", "--request-timeout", str(TIMEOUT_S)]
    yield from serving(ServerProcess(tmp, args, {"HEADROOM_FAULTS_DIR": str(tmp / "faults")}))


def _arm(server: ServerProcess, rules: str) -> None:
    """Drop a fault file the worker's engine claims at its next step (written whole,
    then renamed into place)."""
    spool = Path(server.env["HEADROOM_FAULTS_DIR"])
    part = spool / "cut.part"
    part.write_text(rules)
    part.rename(spool / "cut.fault")


def _stream_cut(server: ServerProcess, rules: str | None, **body) -> list:
    """The events of a long streamed answer (``body`` overrides :data:`LONG`);
    ``rules`` armed after its first delta."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)
    events = []
    for event in client.responses.create(model="default", stream=True, **{**LONG, **body}):
        events.append(event)
        if rules is not None and event.type == "response.output_text.delta":
            _arm(server, rules)
            rules = None
    return events


def _assert_closed_with_streamed_text(events: list) -> str:
    """The message item's ``.done`` events and its final state carry the text of its
    deltas, ``incomplete``; returns that text."""
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (text_done,) = [e for e in events if e.type == "response.output_text.done"]
    (part_done,) = [e for e in events if e.type == "response.content_part.done"]
    (item_done,) = [e for e in events if e.type == "response.output_item.done"]
    assert text_done.text == part_done.part.text == streamed
    assert kinds.index("response.output_item.done") > kinds.index("response.content_part.done")
    assert item_done.item.status == "incomplete"
    assert item_done.item.content[0].type == "output_text"
    assert item_done.item.content[0].text == streamed
    (final_item,) = events[-1].response.output
    assert final_item.status == "incomplete" and final_item.content[0].text == streamed
    return streamed


def test_a_length_cut_stream_ends_incomplete_with_its_text(cut_server):
    events = _stream_cut(cut_server, None, max_output_tokens=4)
    _assert_closed_with_streamed_text(events)
    end = events[-1]
    assert end.type == "response.incomplete" and end.response.status == "incomplete"
    assert end.response.incomplete_details.reason == "max_output_tokens"
    assert end.response.usage.output_tokens == 4


def test_a_stream_cut_by_the_request_timeout_ends_incomplete_with_its_text(cut_server):
    # Past the timeout, and over soon after it: the next test's request is not held long.
    events = _stream_cut(cut_server, f"slow:*:1:{TIMEOUT_S + 5}")
    streamed = _assert_closed_with_streamed_text(events)
    end = events[-1]
    assert end.type == "response.incomplete", [e.type for e in events[-6:]]
    assert end.response.status == "incomplete"
    assert end.response.incomplete_details.reason == "request_timeout"
    assert end.response.output_text == streamed
    assert end.response.usage.output_tokens > 0
    assert "error" not in [e.type for e in events]
    assert "status=504" in cut_server.log()  # the call's log line still says it timed out


def _wait_idle(server: ServerProcess) -> None:
    """Until the engine runs and holds no request: the timeout test's slow step goes on
    in the worker after its request was cut, and a request sent meanwhile would wait
    for it out of its own ``--request-timeout``."""

    def idle() -> bool:
        with server.client() as http:
            stats = http.get("/api/status").json()["counters"]["engine"]
        return stats is not None and stats["running"] == 0 and stats["waiting"] == 0

    wait_for(idle, 120, "the engine to finish the slow step", interval_s=0.2)


def test_a_stream_cut_by_an_engine_error_fails_with_its_text(cut_server):
    """Last in this file: every later step of this server runs out of memory."""
    _wait_idle(cut_server)
    events = _stream_cut(cut_server, "prefill:*:1000,decode:*:1000")
    _assert_closed_with_streamed_text(events)
    error, end = events[-2:]
    assert error.type == "error" and error.code == "out_of_memory"
    assert end.type == "response.failed" and end.response.status == "failed"
    assert end.response.error.code == "out_of_memory"
