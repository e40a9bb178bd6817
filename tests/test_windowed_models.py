"""The checks every model with sliding-window layers passes against transformers (eager
attention), each on a tiny random config whose window (8 tokens) is shorter than the
prompts: Gemma 3 (with and without capped logits), Gemma 4 and gpt-oss. Logits over the
paged KV cache through prefill, extend and decode and in a ragged batch; greedy ids
through the engine alone, batched, with chunked prefill and after a prefix-cache hit;
the C decode layer declining them. Each family's own checks are in its module."""

from __future__ import annotations

import pytest
from model_checks import (
    STEPS,
    VOCAB,
    check_extend_and_decode,
    check_greedy_engine_runs,
    check_prefix_cache_hit,
    check_ragged_batch,
    pair_fixture,
)

from engine.layers.cpu_decode import CpuDecode

pytest.importorskip("transformers")

pair = pair_fixture(["gemma3", "gemma3_capped", "gemma4", "gpt_oss"], VOCAB)


def test_paged_logits_match_transformers(pair, paged_runner):
    """One sequence: 7 tokens, 5 more, then 3 decode steps, past the window of 8 on the
    way; then two ragged sequences sharing each step."""
    _, hf, ours, config, _ = pair
    check_extend_and_decode(hf, paged_runner(ours, config), VOCAB)
    check_ragged_batch(hf, paged_runner(ours, config), VOCAB)


def test_greedy_ids_equal_transformers_alone_batched_and_chunked(pair):
    """Alone, three prompts batched, and the longest in chunks of 8 and of 5 tokens."""
    _, hf, _, _, path = pair
    check_greedy_engine_runs(hf, path, VOCAB, STEPS)


def test_prefix_cache_hit_equals_transformers(pair):
    """With every token kept (``--sliding-kv-ring off``) a second prompt sharing a 20-token
    prefix reuses its pages and still decodes as transformers does from scratch. (With
    the default ring a prefix is reused only up to a node holding a ring checkpoint:
    tests/test_sliding_kv_ring.py.)"""
    _, hf, _, _, path = pair
    check_prefix_cache_hit(hf, path, VOCAB, STEPS, sliding_kv_ring="off")


def test_the_c_decode_layer_declines_them(pair):
    _, _, ours, _, _ = pair
    assert CpuDecode.build(ours, lib=None) is None
