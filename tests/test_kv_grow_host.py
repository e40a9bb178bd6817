"""A live resize of the KV pool on the CPU must never take the host down (a new user's
finds): the resize copies only the pages requests wrote, so the pool's untouched pages
stay out of the process's resident memory; a resize longer than the stall timeout is
progress, not a stall; a grow whose new pool the host's available memory cannot hold is
refused before the worker tries, naming the most that fits.

Memory is measured (``/proc/self/status``, Linux), never time."""

from __future__ import annotations

import re
import sys

import httpx
import pytest
from test_engine import run_all

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.memory.host import host_memory
from engine.wire.messages import SamplingParams

MiB = 1 << 20
# What a resize may add to the resident memory beside the pages that hold data: torch's
# and the allocator's slack. Before the fix a resize copied every kept page: 256 MiB or
# more in each step below.
RESIZE_SLACK = 48 * MiB


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_cpu_resize_keeps_the_pages_no_request_wrote_out_of_memory(default_model_dir):
    engine = Engine(EngineConfig(model=default_model_dir, device="cpu", kv_cache=256 << 20, min_context=256))
    prompt = {"a": (list(range(100, 300)), SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))}
    first = run_all(engine, prompt)
    page = engine.kv_page_bytes
    start = engine.pool.num_pages
    for pages in (1536 * MiB // page, 512 * MiB // page, 1536 * MiB // page):
        before = _rss()
        engine.resize_kv_pool(pages)
        assert engine.pool.num_pages == pages
        grown = _rss() - before
        assert grown < RESIZE_SLACK, f"resize to {pages} pages (from {start}) made {grown / MiB:.0f} MiB resident"
    # The written pages were copied: the cached prompt is found and gives the same ids.
    hits = engine.stats().prefix_hit_tokens
    assert run_all(engine, prompt) == first
    assert engine.stats().prefix_hit_tokens - hits >= 192
