"""``headroom serve --tensor-parallel-size 2 --device cpu``: the two ranks are one worker
to the supervisor. A rank SIGKILLed ends the group, which restarts whole (no rank of the
old group left) and the next request succeeds; a live shrink of the pool (one rank's simulated
card filling up) reaches both ranks, each reporting its pool size."""

from __future__ import annotations

import json
import os
import re
import signal

import psutil
import pytest
from service_harness import process_gone, wait_for

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, make_tiny_hf_model, smollm_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3-tp")
    make_tiny_hf_model("qwen3", folder, vocab_size=len(smollm_tokenizer), max_position_embeddings=512)
    smollm_tokenizer.save_pretrained(folder)
    return str(folder)


def _ranks(worker_pid: int) -> list[int]:
    """The worker's rank children (multiprocessing's resource tracker left out)."""
    children = psutil.Process(worker_pid).children()
    return [c.pid for c in children if "resource_tracker" not in " ".join(c.cmdline())]


def _chat(server) -> dict:
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _group_restarts_after(server, leader: int, rank1: int) -> None:
    """The old group ends whole, a new one serves, nothing of the old one lives on."""
    wait_for(lambda: process_gone(leader), 120, "rank 0 to end with its group")
    wait_for(lambda: (r := server.health()).status_code == 200 and r.json()["worker_pid"] not in (None, leader),
             180, "the group to restart")
    assert _chat(server)["choices"][0]["message"]["content"] is not None
    assert process_gone(leader) and process_gone(rank1)
    assert len(_ranks(server.worker_pid())) == 1


def _serving_group(start_server, tiny_qwen3, *flags: str) -> tuple:
    server = start_server(["--model", tiny_qwen3, "--device", "cpu", "--tensor-parallel-size", "2", *flags])
    _chat(server)
    leader = server.worker_pid()
    ranks = wait_for(lambda: _ranks(leader) or None, 30, "rank 1 as the worker's child")
    assert len(ranks) == 1
    return server, leader, ranks[0]


def test_a_killed_rank_restarts_the_whole_group(start_server, tiny_qwen3):
    server, leader, rank1 = _serving_group(start_server, tiny_qwen3)
    os.kill(rank1, signal.SIGKILL)
    _group_restarts_after(server, leader, rank1)
    assert "ending the tensor-parallel group" in server.log()


def test_a_hung_rank_restarts_the_whole_group(start_server, tiny_qwen3):
    """Rank 1 stopped (SIGSTOP): rank 0 waits in the step's collective, its heartbeat
    thread beats on with a work counter that stands still, the watchdog ends it and the
    parent-death signal ends rank 1."""
    server, leader, rank1 = _serving_group(start_server, tiny_qwen3, "--stall-timeout-s", "5")
    os.kill(rank1, signal.SIGSTOP)
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "temperature": 0}, timeout=300)
    assert r.status_code in (200, 503), r.text  # retried on the new group, or failed as for one worker
    _group_restarts_after(server, leader, rank1)
    assert "made no progress" in server.log()


def test_a_live_shrink_reaches_both_ranks(start_server, tiny_qwen3, tmp_path):
    """GPU 1 fills up while GPU 0 stays free: the watcher follows the tightest GPU, so
    both ranks' pools shrink; /api/status shows both GPUs, the tightest on top."""
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"steps": [[0, 0]], "gpus": {"1": [[0, 0], [3, "1.5GiB"]]}}))
    flags = ("--device cpu --device-total 8GiB --device-limit 4GiB --max-model-len 512 --vram-source simulated "
             "--tensor-parallel-size 2 --replan-hold 1")
    server = start_server(["--model", tiny_qwen3, *flags.split(), "--vram-timeline", str(timeline)])
    with server.client() as http:
        planned = http.get("/api/status").json()["engine"]["info"]["num_pages"]
        pages = lambda: http.get("/api/status").json()["engine"]["info"]["num_pages"]  # noqa: E731
        shrunk = wait_for(lambda: (p := pages()) < planned and p, 120, "the pool to shrink")
        vram = http.get("/api/status").json()["vram"]
    assert [(g["rank"], g["device"]) for g in vram["gpus"]] == [(0, "simulated GPU 0 (8.00 GiB)"),
                                                                 (1, "simulated GPU 1 (8.00 GiB)")]
    assert vram["device"] == vram["gpus"][1]["device"]
    assert vram["gpus"][0]["others_bytes"] == 0 < vram["gpus"][1]["others_bytes"] == vram["others_bytes"]
    # Each rank logs the pool it now holds; rank 0 checked that they agree.
    reports = wait_for(
        lambda: (found := re.findall(r"KV pool on rank (\d): (\d+) pages", server.log())) and
        {r for r, p in found if int(p) == shrunk} == {"0", "1"} and found, 30, "both ranks' reports")
    assert reports
    _chat(server)
