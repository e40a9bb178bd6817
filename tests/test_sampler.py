"""Sampler: penalties and filters against transformers, seeds, batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampling.sampler import InvalidLogitsError, Sampler
from engine.sampling.state import SamplingState
from engine.wire.messages import GREEDY_TEMPERATURE, SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


def _states(params, vocab_size, device="cpu", prompts=None):
    prompts = prompts or [[] for _ in params]
    return [SamplingState(p, pr, vocab_size, device) for p, pr in zip(params, prompts, strict=True)]


def _hf_warp(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate's order: temperature, top-k, top-p, min-p."""
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores


# --- penalties -------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(0)
    V = 300
    logits = torch.randn(3, V, generator=g) * 4
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),  # < 1 rewards repeats
        SamplingParams(),  # untouched row between penalized ones
    ]
    prompts = [[1, 5, 5, 17, 200], [0, 299, 42], [1, 5]]
    generated = [[17, 3, 3, 250], [8], [5, 6]]
    states = _states(params, V, prompts=prompts)
    for s, gen in zip(states, generated, strict=True):
        for t in gen:
            s.append(t)

    out = Sampler.penalize(logits, states, params)

    for i, p in enumerate(params):
        ids = torch.tensor([prompts[i] + generated[i]])
        want = logits[i : i + 1].clone()
        if p.repetition_penalty != 1.0:
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, want)
        torch.testing.assert_close(out[i : i + 1], want, rtol=0, atol=0)
    assert torch.equal(logits, torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 4)


def test_presence_frequency_penalties_count_generated_tokens_only():
    V = 20
    logits = torch.linspace(-3, 3, V).unsqueeze(0)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    (state,) = _states([p], V, prompts=[[9, 9, 3]])  # prompt tokens are not penalized
    for t in [3, 3, 5, 7, 3]:
        state.append(t)

    out = Sampler.penalize(logits, [state], [p])

    want = logits.clone()
    for tok, count in {3: 3, 5: 1, 7: 1}.items():  # OpenAI: c * freq + (c > 0) * presence
        want[0, tok] -= count * 0.25 + 0.5
    torch.testing.assert_close(out, want)
    assert out[0, 9] == logits[0, 9]


def test_repetition_then_presence_frequency():
    V = 8
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0, 3.0, -1.0, 4.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    (state,) = _states([p], V, prompts=[[0, 1]])
    for t in [2, 2, 1]:
        state.append(t)

    out = Sampler.penalize(logits, [state], [p])

    want = logits.clone()
    want[0, 0] = 2.0 / 2  # prompt only: repetition penalty
    want[0, 1] = -2.0 * 2 - (1 * 0.5 + 1.0)  # prompt and generated once
    want[0, 2] = 1.0 / 2 - (2 * 0.5 + 1.0)  # generated twice
    torch.testing.assert_close(out, want)


# --- filters ---------------------------------------------------------------------------

FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=50),
    SamplingParams(top_p=0.9),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=5000, top_p=0.5),  # top_k > vocab
    SamplingParams(temperature=2.0, top_p=0.3, min_p=0.2),
    SamplingParams(),
]


@pytest.mark.parametrize("seed", [0, 1])
def test_filters_match_transformers_in_a_mixed_batch(seed):
    g = torch.Generator().manual_seed(seed)
    V = 1000
    logits = torch.randn(len(FILTER_CASES), V, generator=g) * 3

    out = Sampler.filter(logits, FILTER_CASES)  # one row per config, all in one batch

    for i, p in enumerate(FILTER_CASES):
        want = _hf_warp(logits[i : i + 1].clone(), p)
        kept = torch.isfinite(out[i])
        assert torch.equal(kept, torch.isfinite(want[0])), p
        torch.testing.assert_close(
            torch.log_softmax(out[i], -1)[kept], torch.log_softmax(want[0], -1)[kept]
        )


def test_top_k_larger_than_vocab_keeps_everything():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    out = Sampler.filter(logits, [SamplingParams(top_k=10_000)] * 2)
    torch.testing.assert_close(out, logits - logits.amax(-1, keepdim=True))


def test_tiny_temperature_gives_no_nan_and_picks_the_best():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 100, generator=g) * 100
    for t in (1e-6, 1e-30, 1e-45):
        params = [SamplingParams(temperature=t, seed=i) for i in range(4)]
        out = Sampler.filter(logits, params)
        assert not torch.isnan(out).any()
        tokens = Sampler().sample(logits, _states(params, 100), params)
        assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_a_temperature_that_underflows_float32_samples_greedily(device):
    """1e-300 is 0 in float32: dividing by it made the best token 0/0 = NaN and the row
    unusable (an answer of special tokens that never stopped); below
    GREEDY_TEMPERATURE a row is greedy, so it never divides."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(6)).to(device) * 10
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-300, 5e-324, GREEDY_TEMPERATURE / 2)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    states = _states(params, 100, device)
    before = [st.generator.get_state() for st in states]
    tokens = Sampler().sample(logits, states, params)
    assert torch.equal(tokens.cpu(), logits.argmax(-1).cpu())
    assert all(torch.equal(st.generator.get_state(), b) for st, b in zip(states, before, strict=True))


# --- sampling --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_uses_no_randomness(device):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(5)).to(device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, top_p=0.5),
        SamplingParams(temperature=0.0, seed=7),
    ]
    states = _states(params, 500, device)
    before = [s.generator.get_state() for s in states]

    tokens = Sampler().sample(logits, states, params)

    # The GPU path returns the ids already read back to the host.
    assert torch.equal(tokens.cpu(), logits.argmax(-1).cpu())
    for s, b in zip(states, before, strict=True):
        assert torch.equal(s.generator.get_state(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_50_draws(device):
    V = 200
    g = torch.Generator().manual_seed(6)
    steps = [torch.randn(1, V, generator=g).to(device) for _ in range(50)]
    p = SamplingParams(seed=1234, temperature=1.5)

    def run(params):
        (state,) = _states([params], V, device)
        return [int(Sampler().sample(x, [state], [params])) for x in steps]

    first = run(p)
    assert run(p) == first
    assert run(SamplingParams(seed=1235, temperature=1.5)) != first
    unseeded = SamplingParams(temperature=1.5)
    assert run(unseeded) != run(unseeded)


def test_unseeded_states_get_distinct_seeds():
    seeds = {SamplingState(SamplingParams(), [], 10, "cpu").seed for _ in range(64)}
    assert len(seeds) == 64


BATCH_PARAMS = [
    SamplingParams(seed=0),
    SamplingParams(seed=1, temperature=0.0),
    SamplingParams(seed=2, top_k=20),
    SamplingParams(seed=3, top_p=0.8),
    SamplingParams(seed=4, min_p=0.1),
    SamplingParams(seed=5, temperature=0.5, top_k=50, top_p=0.9),
    SamplingParams(seed=6, repetition_penalty=1.3),
    SamplingParams(seed=7, presence_penalty=0.8, frequency_penalty=0.4),
    SamplingParams(seed=8, top_k=1),
    SamplingParams(seed=9, temperature=2.0, min_p=0.05),
    SamplingParams(seed=10, temperature=1e-4),
    SamplingParams(seed=11, top_p=1e-4),
    SamplingParams(seed=12, temperature=0.0, repetition_penalty=1.5),
    SamplingParams(seed=13, temperature=0.9, top_k=100, repetition_penalty=1.1),
    SamplingParams(seed=14, temperature=1.2, top_p=0.95, frequency_penalty=1.0),
    SamplingParams(seed=15, top_k=10**6),
]


@pytest.mark.parametrize("device", DEVICES)
def test_batch_of_16_gives_each_row_what_it_gets_alone(device):
    V, steps = 512, 12
    g = torch.Generator().manual_seed(8)
    logits = [torch.randn(len(BATCH_PARAMS), V, generator=g).to(device) for _ in range(steps)]
    prompts = [[i, i + 1, 2 * i] for i in range(len(BATCH_PARAMS))]
    sampler = Sampler()

    states = _states(BATCH_PARAMS, V, device, prompts)
    batched = []
    for x in logits:
        tokens = sampler.sample(x, states, BATCH_PARAMS).tolist()
        for s, t in zip(states, tokens, strict=True):
            s.append(t)
        batched.append(tokens)

    for i, p in enumerate(BATCH_PARAMS):
        (state,) = _states([p], V, device, [prompts[i]])
        for step, x in enumerate(logits):
            t = int(sampler.sample(x[i : i + 1], [state], [p]))
            assert t == batched[step][i], (i, step, p)
            state.append(t)


def test_temperature_one_matches_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 4000
    params = [SamplingParams(seed=i) for i in range(n)]
    logits = probs.log().expand(n, -1)

    tokens = Sampler().sample(logits, _states(params, 5), params)

    observed = torch.bincount(tokens, minlength=5).double()
    expected = probs.double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.0  # 4 degrees of freedom: P(chi2 > 20) ~ 5e-4


def test_temperature_sharpens_as_expected():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 3000
    params = [SamplingParams(seed=i, temperature=0.5) for i in range(n)]
    tokens = Sampler().sample(probs.log().expand(n, -1), _states(params, 3), params)

    want = probs**2 / (probs**2).sum()  # softmax(log p / 0.5)
    observed = torch.bincount(tokens, minlength=3).double()
    expected = want.double() * n
    assert float(((observed - expected) ** 2 / expected).sum()) < 16.0  # 2 dof


def test_tiny_top_p_is_greedy():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(32, 1000, generator=g)
    params = [SamplingParams(seed=i, top_p=0.0001) for i in range(32)]
    tokens = Sampler().sample(logits, _states(params, 1000), params)
    assert torch.equal(tokens, logits.argmax(-1))


def test_only_one_finite_logit_is_always_chosen():
    V = 64
    logits = torch.full((6, V), float("-inf"))
    logits[:, 37] = -5.0
    params = [
        SamplingParams(seed=0),
        SamplingParams(seed=1, top_k=1000, top_p=0.5),
        SamplingParams(seed=2, min_p=0.9),
        SamplingParams(seed=3, temperature=1e-8),
        SamplingParams(seed=4, repetition_penalty=1.5, presence_penalty=2, frequency_penalty=1),
        SamplingParams(temperature=0.0),
    ]
    states = _states(params, V, prompts=[[37]] * 6)
    for s in states:
        s.append(37)
    tokens = Sampler().sample(logits, states, params)
    assert tokens.tolist() == [37] * 6


# --- failure paths ---------------------------------------------------------------------


def test_unusable_logits_name_the_rows_and_draw_nothing():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    params = [SamplingParams(seed=i) for i in range(3)]
    states = _states(params, 10)
    before = states[0].generator.get_state()

    with pytest.raises(InvalidLogitsError) as err:
        Sampler().sample(logits, states, params)

    assert err.value.rows == [1, 2]
    assert torch.equal(states[0].generator.get_state(), before)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", math.inf),
    ],
)
def test_bad_params_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingState(SamplingParams(**{field: value}), [], 10, "cpu")


def test_mismatched_batch_is_rejected():
    p = SamplingParams(seed=0)
    (state,) = _states([p], 10)
    sampler = Sampler()
    with pytest.raises(ValueError, match="states"):
        sampler.sample(torch.randn(2, 10), [state], [p])
    with pytest.raises(ValueError, match="vocab"):
        sampler.sample(torch.randn(1, 11), [state], [p])
    with pytest.raises(ValueError, match="params differ"):
        sampler.sample(torch.randn(1, 10), [state], [SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="outside"):
        state.append(10)
    with pytest.raises(ValueError, match="prompt ids"):
        SamplingState(SamplingParams(repetition_penalty=1.2), [3, 10], 10, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_bans_and_forces_tokens(device):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(9)).to(device)
    best = logits.argmax(-1).cpu()
    worst = int(logits[1].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias=((int(best[0]), -100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((worst, 100.0),)),
        SamplingParams(temperature=0.0),
    ]
    tokens = Sampler().sample(logits, _states(params, 500, device), params).cpu()
    banned = logits[0].clone()
    banned[best[0]] -= 100.0
    assert tokens[0] == banned.argmax().cpu() != best[0]
    assert tokens[1] == worst
    assert tokens[2] == best[2]  # rows without a bias are untouched
    sampled = [SamplingParams(temperature=1.0, seed=1, logit_bias=((worst, 100.0),))]
    row = logits[1:2]
    assert Sampler().sample(row, _states(sampled, 500, device), sampled).cpu()[0] == worst
    with pytest.raises(ValueError, match="outside"):
        SamplingState(SamplingParams(logit_bias=((500, 1.0),)), [1], 500, device)
