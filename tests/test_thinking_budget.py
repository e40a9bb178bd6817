"""A thinking block closed at its budget: the tracker's states, the sampler's forced
row, and the engine on a tiny random model (its greedy tokens are known, so where the
close lands is exact)."""

from __future__ import annotations

import pytest
import torch
from test_engine import run_all

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.sampling.sampler import Sampler
from engine.sampling.state import SamplingState
from engine.sampling.thinking import ThinkingTracker, apply_forced
from engine.wire.messages import SamplingParams, ThinkingBudget

CLOSE = (250, 251)


def _written(tracker: ThinkingTracker, tokens: list[int]) -> list[int | None]:
    """What the tracker forces before each of ``tokens`` is appended."""
    forced = []
    for t in tokens:
        forced.append(tracker.forced())
        tracker.append(t)
    return forced


def test_tracker_forces_the_close_once_the_budget_is_spent():
    tracker = ThinkingTracker(ThinkingBudget(tokens=2, close_ids=CLOSE))
    assert _written(tracker, [5, 6, 250, 251, 9]) == [None, None, 250, 251, None]
    assert tracker.ended and not tracker.inside
    # A close the model wrote itself ends the block: nothing is forced after it.
    free = ThinkingTracker(ThinkingBudget(tokens=5, close_ids=CLOSE))
    assert _written(free, [5, 250, 251, 7, 8, 9, 10, 11]) == [None] * 8
    # A close the model has begun is completed, not started over.
    begun = ThinkingTracker(ThinkingBudget(tokens=2, close_ids=CLOSE))
    assert _written(begun, [5, 250, 251]) == [None, None, 251]


def test_tracker_counts_from_where_the_model_opens_its_block():
    tracker = ThinkingTracker(ThinkingBudget(tokens=1, close_ids=CLOSE, open_ids=(40, 41)))
    assert _written(tracker, [3, 40, 41, 7, 250, 251, 8]) == [None, None, None, None, 250, 251, None]
    # Budget 0 (thinking off): a block the model opens is closed at once.
    off = ThinkingTracker(ThinkingBudget(tokens=0, close_ids=CLOSE, open_ids=(40,)))
    assert _written(off, [3, 40, 250, 251]) == [None, None, 250, 251]
    with pytest.raises(ValueError):
        ThinkingTracker(ThinkingBudget(tokens=-1, close_ids=CLOSE))


def test_forced_row_takes_its_token_and_keeps_its_logprob_whole():
    logits = torch.randn(2, 300)
    forced = apply_forced(logits, [None, 251])
    assert torch.equal(forced[0], logits[0])
    assert forced[1].isfinite().sum() == 1 and forced[1, 251] == logits[1, 251]
    assert apply_forced(logits, [None, None]) is logits
    params = [
        SamplingParams(temperature=1.0, seed=3, logprobs=1),
        SamplingParams(temperature=1.0, seed=4, logprobs=1, thinking=ThinkingBudget(tokens=0, close_ids=CLOSE)),
    ]
    states = [SamplingState(p, [1, 2], 300, "cpu") for p in params]
    records: list = []
    tokens = Sampler().sample(logits, states, params, records)
    assert int(tokens[1]) == 250 and records[1].token_id == 250 and records[1].logprob == 0.0
    assert states[1].constrained and not states[0].constrained


def test_engine_closes_the_block_at_its_budget(tmp_path, make_tiny_hf_model):
    make_tiny_hf_model("llama", tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", page_size=4, num_pages=128))
    prompt = list(range(3, 20))
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    plain = run_all(engine, {"plain": (prompt, greedy)})["plain"]
    close = tuple(t for t in CLOSE if t not in plain[:4]) or (252,)
    opened = SamplingParams(
        max_new_tokens=10, temperature=0.0, ignore_eos=True,
        thinking=ThinkingBudget(tokens=3, close_ids=close),
    )
    # The model opens its block with its second token: two more are free.
    model_opens = SamplingParams(
        max_new_tokens=10, temperature=0.0, ignore_eos=True,
        thinking=ThinkingBudget(tokens=2, close_ids=close, open_ids=(plain[1],)),
    )
    out = run_all(engine, {"a": (prompt, opened), "b": (prompt, model_opens), "c": (prompt, greedy)})
    n, opens = len(close), plain.index(plain[1]) + 1  # tokens up to the block's opening
    assert out["a"][:3] == plain[:3] and tuple(out["a"][3 : 3 + n]) == close
    cut = opens + 2
    assert out["b"][:cut] == plain[:cut] and tuple(out["b"][cut : cut + n]) == close
    assert out["c"] == plain  # a row without a budget in the same batch is untouched
    assert len(out["a"]) == len(out["b"]) == 10  # the answer goes on after the close
