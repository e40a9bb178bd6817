"""The GPU sampler's kernels against their torch reference and the CPU sampler.

Supports (what top-k/top-p/min-p keep) must equal the reference's exactly, greedy rows
must be exact argmaxes, seeded rows must not depend on the batch, and the draws must
follow the filtered probabilities. Without a GPU the kernels run in Triton's
interpreter (slow per row, so the statistics there use few draws; tests/gpu repeats
them with many).
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import kernel_device

from engine.sampling.device import DeviceSampler
from engine.sampling.sampler import Sampler
from engine.sampling.state import SamplingState
from engine.wire.messages import SamplingParams as SP
from kernels.sampling import reference as ref
from kernels.sampling.reference import INVALID_TOKEN

V = 50
MIX = [
    SP(temperature=0.0, repetition_penalty=1.2),  # greedy, penalized
    SP(temperature=0.7, top_k=10),
    SP(temperature=1.0, top_p=0.8),
    SP(temperature=1.3, min_p=0.05, seed=3),
    SP(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, top_k=20, top_p=0.9),
    SP(temperature=1.0, top_k=1),  # greedy by top-k
    SP(temperature=0.5, top_k=5, top_p=0.5, min_p=0.2, seed=11),
]


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


@pytest.fixture(scope="module")
def triton_kernels(dev):
    from kernels.sampling import triton_kernel as triton_sampling

    return triton_sampling


def _states(params, device, vocab=V):
    states = [SamplingState(p, [1, 2, 3, 40], vocab, device) for p in params]
    for s in states:
        for t in (5, 5, 7, 2):
            s.append(t)
    return states


def _run(kernels, device, logits, params, states=None):
    states = states or _states(params, device, logits.shape[1])
    sampler = DeviceSampler(device, capacity=2, kernels=kernels)
    sampler.load(states, params, logits.shape[1])
    filtered = torch.empty(logits.shape, dtype=torch.float32, device=device)
    tokens = sampler.sample_on_device(logits, states, params, filtered)
    return tokens.cpu(), filtered.cpu()


def _logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_reference_filters_match_the_cpu_sampler():
    """The packed-parameter reference keeps exactly what Sampler.filter keeps."""
    logits = _logits(len(MIX))
    states = _states(MIX, "cpu")
    _, filtered = _run(ref, "cpu", logits, MIX, states)
    penalized = Sampler.penalize(logits, states, MIX)
    for i, p in enumerate(MIX):
        want = penalized[i : i + 1] if p.greedy else Sampler.filter(penalized[i : i + 1], [p])
        if p.greedy:  # greedy rows are penalized only
            torch.testing.assert_close(filtered[i : i + 1], want, rtol=0, atol=0)
        assert torch.equal(torch.isinf(filtered[i]), torch.isinf(want[0])), f"row {i}"
        torch.testing.assert_close(filtered[i], want[0], rtol=1e-6, atol=1e-6)


def test_kernel_supports_equal_the_reference(dev, triton_kernels):
    logits = _logits(len(MIX), seed=1)
    ref_tokens, ref_filtered = _run(ref, "cpu", logits, MIX)
    tokens, filtered = _run(triton_kernels, dev, logits.to(dev), MIX)
    assert torch.equal(torch.isinf(filtered), torch.isinf(ref_filtered))
    finite = torch.isfinite(ref_filtered)
    torch.testing.assert_close(filtered[finite], ref_filtered[finite], rtol=1e-6, atol=1e-5)
    greedy = torch.tensor([p.greedy for p in MIX])
    assert torch.equal(tokens[greedy], ref_tokens[greedy])
    assert all(bool(torch.isfinite(filtered[i, t])) for i, t in enumerate(tokens.tolist()))


def test_greedy_rows_are_exact_argmaxes_with_ties(dev, triton_kernels):
    """Over a vocabulary of three kernel chunks, ties inside and across chunks."""
    vocab = 9000
    params = [SP(temperature=0.0), SP(temperature=0.8, seed=1), SP(temperature=0.0, frequency_penalty=0.5),
              SP(temperature=0.0)]
    logits = _logits(4, vocab=vocab, seed=2).round()  # many ties
    logits[0, [4500, 4600, 8999]] = 50.0  # tie at the max across chunks: the first index wins
    logits[2, [5, 9]] = 50.0  # token 5 was generated twice: penalized below 9
    logits[3, [8200, 8201]] = 60.0  # tie inside the last chunk
    states = _states(params, dev, vocab)
    tokens, _ = _run(triton_kernels, dev, logits.to(dev), params, states)
    penalized = Sampler.penalize(logits.to(dev), states, params).cpu()
    assert tokens[[0, 2, 3]].tolist() == [4500, 9, 8200]
    assert tokens[[0, 2, 3]].tolist() == penalized[[0, 2, 3]].argmax(dim=-1).tolist()


def test_all_greedy_batches_take_the_argmax_path(dev):
    from engine.sampling.device import greedy_tokens

    logits = _logits(4, seed=9)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[3, [10, 20]] = 99.0
    tokens = greedy_tokens(logits.to(dev)).cpu()
    assert tokens.tolist() == [int(logits[0].argmax()), INVALID_TOKEN, INVALID_TOKEN, 10]


def test_seeded_rows_do_not_depend_on_the_batch(dev, triton_kernels):
    p = SP(temperature=1.0, seed=1234)
    other = SP(temperature=0.7, top_k=5)
    row = _logits(1, seed=3)
    noise = _logits(3, seed=4)
    alone, _ = _run(triton_kernels, dev, row.to(dev), [p])
    batch = torch.cat([noise[:2], row, noise[2:]])
    mixed, _ = _run(triton_kernels, dev, batch.to(dev), [other, SP(), p, other])
    assert mixed[2] == alone[0]

    # The step is part of the key: later tokens of the same request follow new draws.
    flat = torch.zeros(1, V)  # uniform: every token as likely
    draws = []
    for step in range(6):
        state = SamplingState(p, [], V, dev)
        state.num_generated = step
        tokens, _ = _run(triton_kernels, dev, flat.to(dev), [p], [state])
        draws.append(int(tokens[0]))
    assert len(set(draws)) > 1


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    assert counts[expected == 0].sum() == 0, "drew a token outside the support"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _draw_many(kernels, device, p: SP, logits_row: torch.Tensor, n: int):
    params = [SP(**{**_fields(p), "seed": s}) for s in range(n)]
    states = [SamplingState(q, [], logits_row.numel(), device) for q in params]
    logits = logits_row.expand(n, -1).contiguous().to(device)
    tokens, filtered = _run(kernels, device, logits, params, states)
    return tokens, torch.softmax(filtered[0], dim=-1)


def _fields(p: SP) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


# chi-square 0.999 quantiles by degrees of freedom (the draws are seeded, so a test
# passes or fails deterministically; the bound only sets how big a bias it catches).
_CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def test_reference_draws_follow_the_probabilities():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    p = SP(temperature=0.8, top_p=0.95)
    tokens, probs = _draw_many(ref, "cpu", p, logits, 4000)
    support = int((probs > 0).sum())
    assert support < 8  # top-p removed the tail
    assert _chi_square(tokens, probs) < _CHI2_999[support - 1]


def test_kernel_draws_follow_the_probabilities(dev, triton_kernels):
    n = 20000 if dev == "cuda" else 200
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    # top-k drops -3.0; min-p drops -0.5 and -1.0 (exp((x - 2) / 0.8) < 0.05)
    p = SP(temperature=0.8, top_k=7, min_p=0.05)
    tokens, probs = _draw_many(triton_kernels, dev, p, logits, n)
    support = int((probs > 0).sum())
    assert support == 5
    assert _chi_square(tokens, probs) < _CHI2_999[support - 1]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, on purpose
def test_unusable_rows_give_the_invalid_token(dev, triton_kernels):
    logits = _logits(4, seed=5)
    logits[0, 3] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    params = [SP(temperature=0.7, seed=1), SP(), SP(temperature=1.0), SP(temperature=0.9, seed=2)]
    for kernels, device in ((ref, "cpu"), (triton_kernels, dev)):
        tokens, _ = _run(kernels, device, logits.to(device), params)
        assert tokens[:3].tolist() == [INVALID_TOKEN] * 3
        assert 0 <= int(tokens[3]) < V


def test_device_sampler_keeps_its_tensors_until_a_batch_outgrows_them():
    sampler = DeviceSampler("cpu", capacity=4, kernels=ref)
    fparams, generation = sampler.fparams, sampler.generation
    params = [SP(temperature=0.5, top_p=0.9, seed=7)] * 3
    states = _states(params, "cpu")
    sampler.load(states, params, V)
    assert sampler.fparams is fparams and sampler.generation == generation
    assert sampler.fparams[:3, ref.TOP_P_FLOOR].tolist() == [pytest.approx(0.1)] * 3
    assert sampler.iparams[:3, ref.STEP].tolist() == [4, 4, 4]
    params = params * 3
    sampler.load(_states(params, "cpu"), params, V)
    assert sampler.capacity >= 9 and sampler.generation == generation + 1
