"""Sliding-window rings under tensor parallel on the CPU (gloo): a tiny Gemma 3 (window 8,
pages of 4 tokens, prompts of several windows, so each ring wraps) on two ranks with
``--sliding-kv-ring on`` gives the greedy ids of one rank and of transformers, the
follower reading the ring's page table and slots rank 0 sends each step; a live shrink
mid-run moves live ring pages below the cut and resizes both ranks' ring pools alike;
``headroom plan --tensor-parallel-size 2`` prices one rank's ring pool (its KV heads
halved). The same protocol without rings: tests/test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest
from model_checks import VOCAB, greedy_params, hf_greedy, seeded_prompts
from test_cli import invoke
from test_engine import run_all
from test_tensor_parallel import shrunk_mid_run

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.worker.tp_launch import parallel_engine

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

STEPS = 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, make_tiny_hf_model):
    """A tiny Gemma 3 saved to a folder: ``(transformers' model, its folder)``."""
    path = tmp_path_factory.mktemp("gemma3")
    return make_tiny_hf_model("gemma3", path, vocab_size=VOCAB), path


def _config(path, **knobs) -> EngineConfig:
    """The ring on unless ``knobs`` say otherwise, chunks of 16 tokens (rings of 7 pages in
    a chunk's step, 3 between steps: 28 and 12 tokens, shorter than the prompts)."""
    return EngineConfig(**{"model": str(path), "device": "cpu", "page_size": 4, "num_pages": 128,
                           "sliding_kv_ring": "on", "max_prefill_tokens": 16, **knobs})


def _split(config: EngineConfig) -> EngineConfig:
    return EngineConfig(**{**config.__dict__, "tensor_parallel_size": 2})


@pytest.mark.parametrize("ring", ["on", "off"])
def test_tp2_ring_greedy_equals_one_rank_and_transformers(gemma3, ring):
    """Three prompts of 45, 5 and 29 ids batched, 16 greedy ids each: two ranks with rings
    (one KV head each) give one rank's ids, and those are transformers'; so do they with
    ``--sliding-kv-ring off`` (every token kept)."""
    hf, path = gemma3
    prompts = seeded_prompts(VOCAB, 45, 5, 29)
    work = {f"r{i}": (ids, greedy_params(STEPS)) for i, ids in enumerate(prompts)}
    alone = run_all(Engine(_config(path, sliding_kv_ring=ring)), work)
    with parallel_engine(_split(_config(path, sliding_kv_ring=ring))) as engine:
        assert engine.pool.ring_layers == ({0, 1, 3, 4} if ring == "on" else set())
        assert (engine.ring is not None) == (ring == "on") and engine.model_config.num_kv_heads == 1
        split = run_all(engine, work)
    assert split == alone == {f"r{i}": hf_greedy(hf, ids, STEPS) for i, ids in enumerate(prompts)}


def _shrunk_mid_run(engine) -> tuple[dict[str, list[int]], list[int], int]:
    """A 60-token filler takes the lowest pages and ring pages; three prompts join, the
    filler ends after 4 steps and the KV pool shrinks to 20 pages, its ring pool with it
    (the rule without a plan: as many ring pages as pages); then the run ends. Returns
    the ids, the live ring pages at or above the ring pool's cut before the shrink, and
    the ring pool's pages after it."""
    live: set[int] = set()

    def note_live() -> None:
        live.update(p for r in engine.scheduler.running for p in r.ring)
        live.update(p for pages in engine.ring.checkpoint_lists() for p in pages)

    work = {f"r{i}": (ids, greedy_params(STEPS)) for i, ids in enumerate(seeded_prompts(VOCAB, 45, 5, 29))}
    out, result = shrunk_mid_run(engine, seeded_prompts(VOCAB, 60)[0], work, 20, lead_steps=2,
                                 before_shrink=note_live)
    assert result.after_ring_pages < result.before_ring_pages
    return out, sorted(p for p in live if p >= result.after_ring_pages), result.after_ring_pages


def test_tp2_live_shrink_resizes_both_ranks_ring_pools(gemma3):
    """A shrink mid-run with rings: ring pages above the cut move below it on both ranks
    (the copy and the resize reach the follower), both ranks end at the same ring pool,
    and the ids stay one rank's shrunk the same way, and transformers'. The 45-id prompt
    is the filler's first 45 ids, so it starts from the filler's cached prefix: a ring
    checkpoint saved and restored on both ranks."""
    hf, path = gemma3
    alone, moved, ring_pages = _shrunk_mid_run(Engine(_config(path, max_running_requests=8)))
    assert moved  # live ring pages sat above the cut: the ring copy is exercised
    with parallel_engine(_split(_config(path, max_running_requests=8))) as engine:
        split, _, _ = _shrunk_mid_run(engine)
        assert engine.rank_pool_pages == [20, 20] and engine.rank_ring_pages == [ring_pages, ring_pages]
        assert engine.radix.hit_tokens > 0
    assert split == alone
    assert [split[f"r{i}"] for i in range(3)] == [hf_greedy(hf, ids, STEPS)
                                                  for ids in seeded_prompts(VOCAB, 45, 5, 29)]


def test_plan_with_tensor_parallel_prices_one_ranks_ring_pool(gemma3):
    """``headroom plan --tensor-parallel-size 2``: the ring line is there, the same pages
    as one rank alone's at half the bytes (half the KV heads), and the KV pool per token
    over the global layers halved too."""
    _, path = gemma3
    base = ["plan", "--model", str(path), "--device", "cpu", "--device-total", "1GiB", "--reserve", "0", "--json"]
    plans = [json.loads(invoke([*base, "--tensor-parallel-size", str(n)]).stdout) for n in (1, 2)]
    rings = [{e["name"]: e["bytes"] for e in p["ledger"]}["sliding-window KV rings"] for p in plans]
    assert [p["kv_ring_pages"] for p in plans] == [plans[0]["kv_ring_pages"]] * 2 and plans[0]["kv_ring_pages"] > 0
    assert rings[1] * 2 == rings[0]
    assert plans[1]["kv_bytes_per_token"] * 2 == plans[0]["kv_bytes_per_token"]
    text = invoke([*base[:-1], "--tensor-parallel-size", "2"]).stdout
    assert "sliding-window KV rings" in text and "tensor parallel: the plan of one rank of 2" in text
