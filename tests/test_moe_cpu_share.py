"""A host layer's CPU share (engine.layers.moe.cpu_share, share_step; the
``expert_cpu_share`` switch): the split of the uncached experts between the bus and the
cores by their rates, and a decode step with it on the CPU device: the fused kernel's
reference skipping the CPU's experts (lut -2) plus the C job's sums equal the
all-resident layer, the split follows the hot set, and a graph's padding rows cost the
CPU nothing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from engine.layers.moe import expert_cache, share_step  # noqa: E402
from engine.layers.moe.cpu_share import ShareRates, measure_cpu_rates, refit_cpu_rate, split_share  # noqa: E402
from engine.layers.moe.expert_cache import OffloadedExperts  # noqa: E402
from engine.layers.moe.expert_costs import ALWAYS_COPY  # noqa: E402
from engine.layers.moe.expert_counters import ExpertCounters  # noqa: E402
from engine.layers.moe.expert_stacks import BlockStack  # noqa: E402
from kernels.cpu.moe_experts import moe_experts  # noqa: E402
from kernels.cpu.moe_job import CPU_RUN, JobWindow  # noqa: E402
from kernels.moe.quant_reference import fused_moe_quant  # noqa: E402
from kernels.moe.reference import route  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402
from kernels.switches import using  # noqa: E402

TYPES, HIDDEN, INTER, EXPERTS, TOP_K = ("Q4_K", "Q4_K", "Q6_K"), 256, 256, 12, 3
EVEN = ShareRates(bus_s=1.0, cpu_s=1.0, cpu_fixed_s=0.0)


def test_an_even_routing_splits_by_the_rates():
    """No heat yet: every uncached expert as likely; equal rates give half each, a bus
    twice as slow as the cores two thirds to the CPU, and a fixed cost above the whole
    bus half none. Cached experts are in neither half."""
    heat = torch.zeros(EXPERTS)
    cached = {0: 0, 5: 1}
    even = split_share(heat, cached, TOP_K, EVEN)
    assert len(even.cpu) == 5 and not set(even.cpu) & set(cached)
    assert even.cpu_s == pytest.approx(even.bus_s)
    slow_bus = split_share(heat, cached, TOP_K, ShareRates(bus_s=2.0, cpu_s=1.0, cpu_fixed_s=0.0))
    assert len(slow_bus.cpu) in (6, 7) and abs(slow_bus.cpu_s - slow_bus.bus_s) <= 2.0 * TOP_K / EXPERTS
    assert split_share(heat, cached, TOP_K, ShareRates(bus_s=1.0, cpu_s=1.0, cpu_fixed_s=100.0)).cpu == ()
    assert split_share(heat, set(range(EXPERTS)), TOP_K, EVEN).cpu == ()
    assert EVEN.balanced_s(8) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="top_k >= 1"):
        split_share(heat, cached, 0, EVEN)


def test_a_skewed_routing_balances_the_expected_time_of_the_halves():
    """The hot experts count for more: the two halves' expected seconds a step differ by
    less than the likeliest uncached expert's, and a fixed cost moves work to the bus."""
    heat = torch.tensor([9.0, 7.0, 5.0, 4.0, 3.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    rates = ShareRates(bus_s=70e-6, cpu_s=55e-6, cpu_fixed_s=0.0)
    split = split_share(heat, {0: 0}, TOP_K, rates)
    assert 0 not in split.cpu and 1 <= len(split.cpu) < EXPERTS - 1
    assert abs(split.cpu_s - split.bus_s) <= TOP_K * rates.bus_s
    fixed = split_share(heat, {0: 0}, TOP_K, ShareRates(bus_s=70e-6, cpu_s=55e-6, cpu_fixed_s=30e-6))
    assert fixed.cpu_s >= 30e-6 and abs(fixed.cpu_s - fixed.bus_s) <= TOP_K * rates.bus_s
    assert fixed.bus_s > split.bus_s


def _window(calls: list[tuple[int, float]], idle_runs: int = 0) -> JobWindow:
    """The job's window of ``calls`` (pairs, seconds) and ``idle_runs`` calls with no pair."""
    return JobWindow(runs=len(calls) + idle_runs, seconds=sum(t for _, t in calls), pairs=sum(p for p, _ in calls),
                     paired_runs=len(calls), paired_seconds=sum(t for _, t in calls),
                     pairs_sq=sum(p * p for p, _ in calls), pair_seconds=sum(p * t for p, t in calls))


def test_the_cpu_rate_is_refit_to_the_jobs_time_inside_the_steps():
    """10 runs of 4 pairs each took 10 x 5 us of the job's fixed part and 40 x 30 us: no
    spread of pair counts, so no line; the measured 30 us a pair (the old fixed part a
    call aside) is averaged in at REFIT_WEIGHT; too few pairs leave the rates as they
    were (the same object); negative counts are refused."""
    rates = ShareRates(bus_s=50e-6, cpu_s=10e-6, cpu_fixed_s=20e-6, job_fixed_s=5e-6)
    refit = refit_cpu_rate(rates, _window([(4, 5e-6 + 4 * 30e-6)] * 10))
    assert refit.cpu_s == pytest.approx(20e-6) and (refit.bus_s, refit.cpu_fixed_s) == (50e-6, 20e-6)
    assert refit_cpu_rate(rates, _window([(3, 0.2)] * 5)) is rates
    with pytest.raises(ValueError, match=">= 0"):
        refit_cpu_rate(rates, JobWindow(runs=-1, pairs=40))


def test_a_call_s_wake_up_inside_the_steps_is_fit_as_fixed_not_charged_to_its_pairs():
    """One-row steps run two or three CPU pairs a call; inside the steps each call also
    paid 100 us to wake its threads, which the start's back-to-back timing (5 us fixed)
    never saw. Charged to the pairs, that made an expert cost about 88 us, slower than the
    bus's 70, and the split went by costs the step does not have. The least-squares line
    over the calls finds 100 us a call and 50 us a pair (idle calls, which return before
    their threads wake, aside), and its split is the shorter step by those true costs,
    on this file's small layer and on a 30B-A3B's (128 experts, top 8)."""
    calls = [(p, 100e-6 + p * 50e-6) for p in (2, 3, 2, 3, 3, 2, 1, 4)] * 3
    start = ShareRates(bus_s=70e-6, cpu_s=50e-6, cpu_fixed_s=35e-6, job_fixed_s=5e-6)  # trip 30 us
    window = _window(calls, idle_runs=6)
    assert window.line() == pytest.approx((100e-6, 50e-6))
    rates = start
    for _ in range(8):  # refreshes of the same steps: the averages converge
        rates = refit_cpu_rate(rates, window)
    assert rates.cpu_s == pytest.approx(50e-6) and rates.job_fixed_s == pytest.approx(100e-6, rel=1e-2)
    assert rates.cpu_fixed_s == pytest.approx(130e-6, rel=1e-2)  # the trip kept beside the job's fixed part
    pairs = window.pairs
    charged = (window.seconds - window.runs * start.job_fixed_s) / pairs  # the old refit's measure
    assert charged > start.bus_s
    for experts, top_k in ((EXPERTS, TOP_K), (128, 8)):  # this file's layer, a 30B-A3B's
        heat = torch.zeros(experts)
        old_split = split_share(heat, {}, top_k, replace(start, cpu_s=charged))
        new_split = split_share(heat, {}, top_k, rates)
        p = top_k / experts  # each expert's chance of a step, an even routing

        def true_step_s(split, p=p, experts=experts) -> float:  # the two halves, by the true costs
            return max(130e-6 + p * len(split.cpu) * 50e-6, p * (experts - len(split.cpu)) * 70e-6)

        assert true_step_s(new_split) < true_step_s(old_split), (experts, old_split, new_split)
    # The same pair count in every call: no line, the old measure.
    assert JobWindow(runs=3, pairs=6, paired_runs=3, paired_seconds=1.0, pairs_sq=12, pair_seconds=2.0).line() is None


def test_on_cuda_the_job_leaves_the_workers_thread_a_core(monkeypatch):
    monkeypatch.setattr(share_step, "default_threads", lambda: 16)
    assert share_step.job_threads(torch.device("cuda")) == 15
    assert share_step.job_threads(torch.device("cpu")) == 16
    monkeypatch.setattr(share_step, "default_threads", lambda: 2)
    assert share_step.job_threads(torch.device("cuda")) == 2


def test_the_cpu_rates_are_measured_on_the_c_job(lib):
    host = _stack(seed=1)
    per, fixed = measure_cpu_rates(host, lib, repeats=2)
    assert per > 0 and fixed >= 0


def _stack(seed: int) -> BlockStack:
    rng = np.random.default_rng(seed)
    gate, up, down = (torch.from_numpy(np.stack([random_blocks(t, r, c, rng, scale=1e-3) for _ in range(EXPERTS)]))
                      for t, r, c in ((TYPES[0], INTER, HIDDEN), (TYPES[1], INTER, HIDDEN), (TYPES[2], HIDDEN, INTER)))
    return BlockStack(gate, up, down, TYPES)


@pytest.fixture
def shared_layer(lib, monkeypatch):
    """An offloaded layer on the CPU device with 3 slots and the share on at even rates,
    its decode steps taking the bus-read path (the reference kernel reads both tiers)."""
    monkeypatch.setattr(OffloadedExperts, "_reads_over_bus", lambda self, x: x.shape[0] > 0)
    host = _stack(seed=2)
    layer = OffloadedExperts(host, torch.device("cpu"), 3, ExpertCounters(), ALWAYS_COPY, lib, share_rates=EVEN)
    with using(expert_cpu_share="auto"):
        yield host, layer


def _routed(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, renormalize=True)
    return x, weights, ids


def _check_step(host: BlockStack, layer: OffloadedExperts, lib, x, weights, ids) -> torch.Tensor:
    """The layer's step equals the all-resident layer (within the C kernels' rounding of
    the activations), and to float32 order the kernel over the other pairs plus the one
    C call over the CPU's pairs."""
    got = layer(x, weights, ids)
    whole = fused_moe_quant(x, host.gate, host.up, host.down, TYPES, weights, ids)
    assert float((got - whole).abs().max()) <= 1e-3 * float(whole.abs().max())
    on_cpu = torch.isin(ids, torch.tensor(layer.on_cpu, dtype=torch.int64))
    rest = fused_moe_quant(x, host.gate, host.up, host.down, TYPES, weights.masked_fill(on_cpu, 0), ids)
    tokens, ks = torch.where(on_cpu)
    cpu = moe_experts(lib, x, tokens, ids[tokens, ks], weights[tokens, ks], host.gate, host.up, host.down, TYPES)
    assert float((got - (rest + cpu)).abs().max()) <= 1e-6 * float(whole.abs().max())
    return got


def test_a_shared_step_equals_the_all_resident_layer_and_follows_the_hot_set(shared_layer, lib, monkeypatch):
    """Decode steps of 1-4 rows: the first split puts about half of the 9 uncached experts
    on the CPU, the device lut (what the kernel and the job read) says so, and the output
    equals the resident layer's. A refresh (every 2 steps here) that swaps hot experts in
    splits again: the cached experts leave the CPU's half, the lut follows."""
    host, layer = shared_layer
    monkeypatch.setattr(expert_cache, "REFRESH_STEPS", 2)
    x, weights, ids = _routed(4, seed=3)
    assert layer.share_job_totals() == (0, 0.0, 0)  # no job before the first shared step
    _check_step(host, layer, lib, x[:1], weights[:1], ids[:1])
    assert layer.shares_cpu and layer.top_k == TOP_K and 3 <= len(layer.on_cpu) <= 6
    assert layer.share_job_totals()[0] == 1  # one run of the job, timed by itself
    want = torch.tensor([layer.slot_of.get(e, CPU_RUN if e in layer.on_cpu else -1) for e in range(EXPERTS)])
    assert torch.equal(layer._bus.share_lut, want)
    assert torch.equal(layer._bus.lut, want.masked_fill(want == CPU_RUN, -1))
    layer.after_forward(1)
    hot = torch.tensor([[7, 8, 9]] * 4)  # three experts routed every step become the hot set
    before = set(layer.slot_of)
    for step in range(6):
        x, weights, _ = _routed(4, seed=10 + step)
        _check_step(host, layer, lib, x, weights, hot)
        layer.after_forward(4)
    assert set(layer.slot_of) == {7, 8, 9} != before
    assert not set(layer.on_cpu) & set(layer.slot_of) and layer.on_cpu
    want = torch.tensor([layer.slot_of.get(e, CPU_RUN if e in layer.on_cpu else -1) for e in range(EXPERTS)])
    assert torch.equal(layer._bus.share_lut, want)
    x, weights, ids = _routed(4, seed=20)
    _check_step(host, layer, lib, x, weights, ids)
    layer.count_bus_reads()
    c = layer.counters
    assert c.cpu_runs > 0 and c.bus_reads > 0 and c.misses == c.cpu_runs + c.bus_reads + c.copies
    runs, seconds, pairs = layer.share_job_totals()
    assert runs == 8 and pairs == c.cpu_runs and seconds > 0


def test_a_cpu_slower_inside_the_steps_hands_its_experts_back_to_the_bus(lib, monkeypatch):
    """Rates measured at start that call the cores a thousand times faster than the bus
    give the CPU every uncached expert; at the first refresh the rate is refit to what
    the job itself timed in those steps (half the old rate, half the measured one), and
    the next split, at that rate far slower than the bus, gives the CPU none."""
    monkeypatch.setattr(OffloadedExperts, "_reads_over_bus", lambda self, x: x.shape[0] > 0)
    monkeypatch.setattr(expert_cache, "REFRESH_STEPS", 4)
    fast = ShareRates(bus_s=1e-9, cpu_s=1e-12, cpu_fixed_s=0.0)
    layer = OffloadedExperts(_stack(seed=7), torch.device("cpu"), 3, ExpertCounters(), ALWAYS_COPY, lib,
                             share_rates=fast)
    with using(expert_cpu_share="auto"):
        for step in range(4):
            x, weights, ids = _routed(4, seed=30 + step)
            layer(x, weights, ids)
            if step == 0:
                assert len(layer.on_cpu) == EXPERTS - len(layer.slot_of)
            layer.after_forward(4)
        runs, seconds, pairs = layer._share.job.totals()
        assert runs == 4 and pairs >= 16
        assert layer.share_rates.cpu_s == pytest.approx(0.5 * 1e-12 + 0.5 * seconds / pairs)
        assert layer.on_cpu == () and not (layer._bus.share_lut == CPU_RUN).any()


def test_padding_rows_cost_the_cpu_nothing_and_prefill_takes_no_share(shared_layer, lib):
    """A graph's padding rows (LiveRows) give the CPU no pair: the live rows equal the
    resident layer's, and the job ran only the live rows' CPU pairs. A prefill chunk
    (above a decode step's rows) reads every missing expert over the bus."""
    host, layer = shared_layer
    x, weights, ids = _routed(4, seed=4)
    layer(x[:1], weights[:1], ids[:1])  # the first split
    ids[:, 0] = layer.on_cpu[0]  # every row routes to a CPU expert
    layer.live_rows.mark(2)
    try:
        got = layer(x, weights, ids)
    finally:
        layer.live_rows.mark(16)
    whole = fused_moe_quant(x, host.gate, host.up, host.down, TYPES, weights, ids)
    assert float((got[:2] - whole[:2]).abs().max()) <= 1e-3 * float(whole.abs().max())
    live_pairs = int(torch.isin(ids[:2], torch.tensor(layer.on_cpu)).sum())
    assert layer._share.job.status(4) == (0, live_pairs)
    x, weights, ids = _routed(40, seed=5)
    before = layer._share.job.status(4)
    got = layer(x, weights, ids)
    whole = fused_moe_quant(x, host.gate, host.up, host.down, TYPES, weights, ids)
    assert float((got - whole).abs().max()) <= 1e-5 * float(whole.abs().max())  # no C rounding: no CPU pair
    assert layer._share.job.status(4) == before


def test_the_share_is_off_by_default_and_without_rates(lib, monkeypatch):
    monkeypatch.setattr(OffloadedExperts, "_reads_over_bus", lambda self, x: x.shape[0] > 0)
    host = _stack(seed=6)
    layer = OffloadedExperts(host, torch.device("cpu"), 3, ExpertCounters(), ALWAYS_COPY, lib, share_rates=EVEN)
    x, weights, ids = _routed(2, seed=6)
    layer(x, weights, ids)
    assert not layer.shares_cpu and layer.on_cpu == () and layer._share is None
    assert torch.equal(layer._bus.share_lut, layer._bus.lut)
    with using(expert_cpu_share="auto"):
        unmeasured = OffloadedExperts(host, torch.device("cpu"), 3, ExpertCounters(), ALWAYS_COPY, lib)
        assert not unmeasured.shares_cpu
        every = OffloadedExperts(host, torch.device("cpu"), EXPERTS, ExpertCounters(), ALWAYS_COPY, lib,
                                 share_rates=EVEN)
        assert not every.shares_cpu  # nothing uncached to share
