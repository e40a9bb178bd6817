"""A live resize of the KV pool on the CPU must never take the host down (a new user's
finds), through a real ``headroom serve`` of the default model:

- a resize copies only the pages requests wrote, so the pool's untouched pages stay out
  of the worker's resident memory (``/proc/PID/status``; before, a grow or a shrink made
  every kept page resident), and the written ones still serve the cached prompt;
- a resize longer than the stall timeout is progress, not a stall: each buffer copied
  advances the work counter, so the watchdog leaves the worker alone, and the control
  call waits for it while it moves on (its wait is the stall timeout without progress;
  a fixed wait answered 503 while the resize went on and succeeded);
- a grow whose new pool, counted whole, the host's available memory cannot hold is
  refused before the worker tries (409 ``no_room``), naming a most that fits below the
  host's memory.

Memory is measured, never time."""

from __future__ import annotations

import re
import sys

import httpx
import pytest
from service_harness import served_greedy_tokens, wait_for

from engine.memory.host import host_memory

MiB = 1 << 20
# What a resize may add to the worker's resident memory beside the pages that hold data:
# torch's and the allocator's slack. Before the fix a resize copied every kept page:
# 180 MiB for the first grow below, 512 MiB for the shrink.
RESIZE_SLACK = 48 * MiB


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _num_pages(server) -> int:
    return httpx.get(f"{server.base_url}/api/status", timeout=30).json()["engine"]["info"]["num_pages"]


def _prefix_hit_tokens(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("headroom_prefix_cache_hit_tokens"))


def _cache(server, size: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/control/cache", json={"kv_cache": size}, timeout=120,
                      headers={"Authorization": f"Bearer {server.token}"})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_a_live_kv_resize_on_the_cpu_stays_in_memory_moves_on_and_fits_the_host(start_server):
    server = start_server(["--num-pages", "256", "--stall-timeout-s", "2", "--heartbeat-interval-s", "0.2"],
                          {"HEADROOM_FAULTS": "slow_resize:*:1:5"})
    worker = server.worker_pid()
    prompt = list(range(100, 300))
    first = served_greedy_tokens(server, prompt, 6)

    # The first grow is slowed to 5 s (its sleeps advance nothing) under a 2 s stall
    # timeout, which is also how long the control call waits without progress: it is
    # answered 202 once the pool has grown, not 503 at 2 s. The shrink and the grow
    # back run at full speed.
    for size in ("1GiB", "512MiB", "1GiB"):
        before, pages_before = _rss(worker), _num_pages(server)
        r = _cache(server, size)
        assert r.status_code == 202, r.text
        assert r.json()["message"].startswith("KV pool "), r.text  # the worker's answer, after the resize
        assert _num_pages(server) != pages_before, (size, r.text)
        grown = _rss(worker) - before
        assert grown < RESIZE_SLACK, f"the resize to {size} made {grown / MiB:.0f} MiB resident"
    log = server.log()
    assert "injected fault: a slow KV pool resize, 5.0 s longer" in log and "killing it" not in log
    assert server.worker_pid() == worker and server.health().json()["restarts"] == 0

    # The written pages were copied: the cached prompt is found and gives the same tokens.
    hits = _prefix_hit_tokens(server)
    assert served_greedy_tokens(server, prompt, 6) == first
    wait_for(lambda: _prefix_hit_tokens(server) - hits >= 192, 30, "the prompt's prefix-cache hit in /metrics")

    # Past the host's available memory with the new pool counted whole: a grow the old
    # check took (the pool's 1 GiB added to the available memory), and 1 PiB.
    pages = _num_pages(server)
    page_bytes = 1024 * MiB // pages
    total, available = host_memory()
    room = total if available is None else available
    for size in (f"{(room + 256 * MiB) // MiB}MiB", "1PiB"):
        r = _cache(server, size)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "no_room" and error["param"] == "kv_cache", error
        assert "of host memory" in error["message"] and "counted whole" in error["message"], error
        found = re.search(r"the most it can grow to now is [\d.]+ \w+ \((\d+) pages\)", error["message"])
        assert found, error["message"]
        most = int(found.group(1))
        assert pages < most and (most + 1) * page_bytes <= total, error["message"]
        assert _num_pages(server) == pages
