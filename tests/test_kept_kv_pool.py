"""The KV pool a live change kept, as the next worker takes it up
(:mod:`engine.worker.kept_pool`), and the one host rule a pool meets at start, in a live
grow and when a kept size is taken (:mod:`engine.memory.host_room`):

- the engine loads with the start's sizing and the worker resizes it to the kept size,
  so the pool it grows back to (the start's) is not the kept one;
- the most a grow may take is the memory available less the margin, and a fixed pool
  of that many pages passes the start's check while one page more is refused there too.
"""

from __future__ import annotations

import logging

import pytest
from resize_runs import NUM_PAGES, make_engine

from engine.common.config import EngineConfig
from engine.common.errors import SettingRefused
from engine.memory.fixed_pool import FixedPoolSize, check_host_room
from engine.memory.host_room import host_margin, host_pool_bytes, host_room, most_host_pages
from engine.wire.ipc import PoolStats
from engine.worker.kept_pool import KEPT_REASON, take_kept_pool
from engine.worker.process import pool_stats

MiB = 1 << 20


def test_a_kept_size_is_taken_after_the_start_sizing_loaded(tiny_dir):
    engine = make_engine(tiny_dir)
    assert take_kept_pool(engine, None, pool_stats(engine, engine.stats(), 0)) is None
    assert engine.pool.num_pages == NUM_PAGES
    assert take_kept_pool(engine, NUM_PAGES // 2, pool_stats(engine, engine.stats(), 0)) == NUM_PAGES // 2
    assert engine.pool.num_pages == NUM_PAGES // 2
    # The start's pool is what a live {"kv_cache": null} goes back to, not the kept one.
    assert engine.kv_pool_ceiling_pages == NUM_PAGES
    assert [e.reason for e in engine.drain_events()] == [KEPT_REASON]
    assert take_kept_pool(engine, NUM_PAGES * 2, pool_stats(engine, engine.stats(), 0)) == NUM_PAGES * 2


def test_a_kept_size_past_the_hosts_memory_keeps_the_most_that_fits(tiny_dir, caplog):
    engine = make_engine(tiny_dir)
    pool = pool_stats(engine, engine.stats(), 0)
    room = host_room()
    # A pool of 4x the host's memory: cut to what fits, with a warning naming the memory.
    kept = 4 * room.total // pool.page_bytes
    with caplog.at_level(logging.WARNING, logger="headroom.worker"):
        taken = take_kept_pool(engine, kept, pool)
    assert NUM_PAGES <= taken < kept and engine.pool.num_pages == taken
    assert host_pool_bytes(pool, taken, "cpu") <= room.pool_bytes + 256 * MiB  # MemAvailable moves a little
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "no longer fits the host's memory" in said and "kept free for a step's activations" in said, said


def test_a_grow_and_the_start_check_leave_the_same_margin():
    room = host_room()
    assert room.margin == host_margin(room.total) >= 512 * MiB
    have = room.total if room.available is None else room.available
    assert room.pool_bytes == max(have - room.margin, 0)
    page = 64 * MiB
    pool = PoolStats(pages=2, planned_pages=2, min_pages=2, page_bytes=page, pool_bytes=2 * page, prefill_chunk=1,
                     planned_prefill_chunk=1, min_prefill_chunk=1, activation_bytes_per_token=0, free_pages=1,
                     cached_pages=0, max_context_tokens=16, fixed_bytes=0)
    most = most_host_pages(pool, 4 * room.total // page, "cpu", room)
    assert most * page <= have - room.margin < (most + 1) * page
    # The same count passes the start's check of --num-pages; one page more (and then
    # some, for MemAvailable moving meanwhile) does not.
    check_host_room(EngineConfig(num_pages=most - 8), FixedPoolSize(most - 8, 0, 0), page, None)
    with pytest.raises(SettingRefused, match="kept free for a step's activations and the system"):
        check_host_room(EngineConfig(num_pages=most + 8), FixedPoolSize(most + 8, 0, 0), page, None)
