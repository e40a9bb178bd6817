"""The C job of a host layer's CPU share (kernels/cpu/moe_job.c through
kernels.cpu.moe_job): given a step's hidden rows, routed ids and weights, the rows' live
flags and the layer's lut, it finds the pairs whose expert the lut gives the CPU
(code -2), runs them over the blocks and writes the weighted sums, zeros elsewhere.

Checked against gguf's dequantizer times the activations (moe_experts_ref: the
activations rounded to the kernels' 16-bit codes, products in float64) and, bit for bit,
against the one-call kernel over the same pairs (moe_experts) as the eager path gathers
them; on odd shapes, rows without a CPU pair, padding rows, bfloat16 and float16 rows,
and from threads Python did not start the job on (as the CUDA runtime's callback thread
calls it).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from kernels.cpu.moe_experts import moe_experts, moe_experts_ref  # noqa: E402
from kernels.cpu.moe_job import CPU_RUN, MoeCpuJob  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402

# (types, hidden, inter): a Q4_K_M layer's types at the K-quants' smallest whole blocks,
# and block-32 types at widths no power of two.
SHAPES = {"q4_k_m": (("Q4_K", "Q4_K", "Q6_K"), 512, 256), "legacy": (("Q8_0", "Q4_0", "Q4_1"), 96, 160)}
EXPERTS, TOP_K, ROWS = 7, 3, 6


def _layer(types, hidden, inter, seed):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.stack([random_blocks(t, r, c, rng, scale=1e-3) for _ in range(EXPERTS)]))
            for t, r, c in ((types[0], inter, hidden), (types[1], inter, hidden), (types[2], hidden, inter))]


def _step(hidden: int, seed: int):
    """Hidden rows, ids ([ROWS, TOP_K], distinct per row), weights and a lut: experts 1,
    4 and 6 run on the CPU, 0 and 2 are cached, the rest read over the bus. Row 2 routes
    to none of the CPU's experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, hidden, generator=gen)
    ids = torch.tensor([[1, 4, 0], [6, 3, 1], [0, 2, 3], [4, 6, 1], [5, 1, 2], [6, 0, 4]])
    weights = torch.rand(ROWS, TOP_K, generator=gen)
    lut = torch.tensor([0, CPU_RUN, 1, -1, CPU_RUN, -1, CPU_RUN])
    return x, ids, weights, lut


def _cpu_pairs(ids, weights, lut, live=None):
    """The CPU's pairs as the eager path gathers them: (tokens, experts, weights)."""
    mask = lut[ids] == CPU_RUN
    if live is not None:
        mask &= live[:, None] > 0
    tokens, ks = torch.where(mask)
    return tokens, ids[tokens, ks], weights[tokens, ks]


def _job(lib, blocks, types, dtype=torch.float32, threads=2):
    return MoeCpuJob(lib, *blocks, types, max_rows=16, top_k=TOP_K, x_dtype=dtype, w_dtype=dtype, threads=threads,
                     pin=False)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_equals_the_reference_over_the_cpu_pairs(lib, shape):
    types, hidden, inter = SHAPES[shape]
    blocks = _layer(types, hidden, inter, seed=hidden)
    x, ids, weights, lut = _step(hidden, seed=1)
    job = _job(lib, blocks, types)
    job.out.fill_(7.0)  # written whole: what it held is gone
    got = job.run(job.load(x, ids, weights, lut)).clone()
    tokens, experts, w = _cpu_pairs(ids, weights, lut)
    want = moe_experts_ref(x, tokens, experts, w, *blocks, types)
    assert got.shape == (ROWS, hidden) and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.equal(got[2], torch.zeros(hidden))  # no CPU pair in row 2
    assert job.status(ROWS) == (0, len(tokens))
    # The one-call kernel over the same pairs, as the eager path runs them: the same bits.
    rows, local = torch.unique(tokens, return_inverse=True)
    once = moe_experts(lib, x[rows], local, experts, w, *blocks, types, threads=2)
    assert torch.equal(got[rows], once)


def test_padding_rows_cost_nothing_and_rows_may_be_fewer_than_the_buffers(lib):
    types, hidden, inter = SHAPES["legacy"]
    blocks = _layer(types, hidden, inter, seed=2)
    x, ids, weights, lut = _step(hidden, seed=2)
    live = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # a graph's padding rows last
    job = _job(lib, blocks, types)
    got = job.run(job.load(x, ids, weights, lut, live)).clone()
    tokens, experts, w = _cpu_pairs(ids, weights, lut, live)
    assert job.status(ROWS)[1] == len(tokens) < len(_cpu_pairs(ids, weights, lut)[0])
    want = moe_experts_ref(x, tokens, experts, w, *blocks, types)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.equal(got[4:], torch.zeros(2, hidden))
    # Three rows of the same buffers: a struct of its own, the others' sums untouched by it.
    three = job.run(job.load(x[:3], ids[:3], weights[:3], lut)).clone()
    assert torch.equal(three, got[:3])
    # No CPU expert at all: zeros, no pair.
    none = job.run(job.load(x, ids, weights, torch.full((EXPERTS,), -1)))
    assert torch.equal(none, torch.zeros(ROWS, hidden)) and job.status(ROWS) == (0, 0)
    # The job's running totals: every call of every row count, its pairs, its own time.
    runs, seconds, pairs = job.totals()
    first, second = len(tokens), len(_cpu_pairs(ids[:3], weights[:3], lut)[0])
    assert (runs, pairs) == (3, first + second) and seconds > 0
    # The line's sums count the two calls that ran pairs, not the one that found none.
    w = job.window()
    assert (w.runs, w.pairs, w.paired_runs, w.pairs_sq) == (3, first + second, 2, first**2 + second**2)
    assert 0 < w.paired_seconds <= w.seconds
    # sum(pairs x seconds) lies between the fewest and the most pairs times the seconds
    low, high = sorted((first, second))
    assert low * w.paired_seconds * (1 - 1e-9) <= w.pair_seconds <= high * w.paired_seconds * (1 + 1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rows_and_weights_are_read_as_their_float32_values(lib, dtype):
    types, hidden, inter = SHAPES["q4_k_m"]
    blocks = _layer(types, hidden, inter, seed=3)
    x, ids, weights, lut = _step(hidden, seed=3)
    x, weights = x.to(dtype), weights.to(dtype)
    job = _job(lib, blocks, types, dtype)
    got = job.run(job.load(x, ids, weights, lut)).clone()
    tokens, experts, w = _cpu_pairs(ids, weights, lut)
    want = moe_experts(lib, x.float(), tokens, experts, w.float(), *blocks, types, threads=2)
    assert torch.equal(got, want)


def test_the_job_runs_from_threads_python_did_not_start_it_on(lib):
    """The CUDA runtime calls a host function on a thread of its own: the job opens its
    OpenMP region there, also while the main thread runs one of its own."""
    types, hidden, inter = SHAPES["q4_k_m"]
    blocks = _layer(types, hidden, inter, seed=4)
    x, ids, weights, lut = _step(hidden, seed=4)
    job = _job(lib, blocks, types, threads=2)
    want = job.run(job.load(x, ids, weights, lut)).clone()
    results: list[torch.Tensor] = []

    def on_thread() -> None:
        for _ in range(3):
            results.append(job.run(ROWS).clone())

    worker = threading.Thread(target=on_thread)
    worker.start()
    tokens, experts, w = _cpu_pairs(ids, weights, lut)
    for _ in range(3):  # the main thread's own region meanwhile
        moe_experts(lib, x, tokens, experts, w, *blocks, types, threads=2)
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert len(results) == 3 and all(torch.equal(r, want) for r in results)


def test_the_job_refuses_what_it_cannot_take(lib):
    types, hidden, inter = SHAPES["legacy"]
    blocks = _layer(types, hidden, inter, seed=5)
    x, ids, weights, lut = _step(hidden, seed=5)
    job = _job(lib, blocks, types)
    bad = ids.clone()
    bad[1, 1] = EXPERTS
    with pytest.raises(RuntimeError, match="outside the layer's experts"):
        job.run(job.load(x, bad, weights, lut))
    assert job.refused() == f"{ROWS} rows: a routed id outside the layer's experts"
    with pytest.raises(ValueError, match="1..16 rows"):
        job.pointer(17)
    with pytest.raises(ValueError, match=r"\[<= 16, 96\]"):
        job.load(torch.randn(2, 64), ids[:2], weights[:2], lut)
    with pytest.raises(ValueError, match="the C kernels read"):
        MoeCpuJob(lib, *blocks, ("Q5_0", "Q4_0", "Q4_1"), 4, TOP_K, torch.float32, torch.float32, 1, pin=False)
    with pytest.raises(ValueError, match="not torch.float64"):
        MoeCpuJob(lib, *blocks, types, 4, TOP_K, torch.float64, torch.float32, 1, pin=False)
