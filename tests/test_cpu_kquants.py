"""The C CPU kernels over K-quant blocks (kernels/cpu/kquant.c) and a MoE layer's CPU
experts in one call (kernels/cpu/moe_experts.c): each against its torch reference built
on gguf's dequantizer, on odd shapes, in the vector build and the plain C one; and the
expert cost model timing the C run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from kernels.cpu.block_gemv import block_gemv, block_gemv_ref  # noqa: E402
from kernels.cpu.moe_experts import moe_experts, moe_experts_ref  # noqa: E402
from kernels.quant import reference  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402
from kernels.switches import using  # noqa: E402

KQUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(type_name, rows, cols, np.random.default_rng(seed)))


@pytest.mark.parametrize("type_name", KQUANTS)
@pytest.mark.parametrize(("rows", "cols", "m"), [(37, 768, 1), (13, 256, 3), (5, 512, 17), (21, 512, 13)])
def test_kquant_gemv_equals_gguf_s_dequantizer_times_the_activations(lib, type_name, rows, cols, m):
    """Rows not a multiple of anything, 1-3 blocks a row, 1, 3, 13 and 17 activation rows
    (the kernel's tile of 4 and its remainders; over 6 rows the AVX-512 tile widens its
    blocks once for several passes, with groups of 8 and 4 rows); the vector and plain C builds both within
    float32 summation order of the reference (a few ulps of ``|x| @ |w|.T``), and of each
    other."""
    blocks = _blocks(type_name, rows, cols, rows * cols + m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(rows))
    x[0, 3] = 40.0  # an outlier, as real activations have
    w = reference.dequantize(blocks, type_name, cols)
    tol = float((x.abs() @ w.abs().T).max()) * 2e-6
    want = block_gemv_ref(x, blocks, type_name)
    vector = block_gemv(lib, x, blocks, type_name)
    plain = block_gemv(lib, x, blocks, type_name, scalar=True)
    assert vector.shape == (m, rows) and vector.dtype == torch.float32
    assert float((vector - want).abs().max()) <= tol
    assert float((plain - want).abs().max()) <= tol
    assert float((vector - plain).abs().max()) <= tol
    # Against unrounded activations: within a 16-bit code's rounding, half a step of
    # each block's largest value, times the weights.
    exact = (x.double() @ w.double().T).float()
    step = x.view(m, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(m, cols) / 65534
    assert bool(((vector - exact).abs() <= step @ w.abs().T * 1.01 + tol).all())


def test_kquant_gemv_refuses_rows_that_are_not_whole_blocks(lib):
    blocks = _blocks("Q4_K", 4, 256, 0)
    with pytest.raises(ValueError, match="do not match"):
        block_gemv(lib, torch.randn(1, 288), blocks, "Q4_K")  # K = 288 is not whole blocks of 256


def _experts(types: tuple[str, str, str], num: int, hidden: int, inter: int, seed: int):
    rng = np.random.default_rng(seed)
    stacks = [np.stack([random_blocks(t, rows, cols, rng, scale=1e-3) for _ in range(num)])
              for t, rows, cols in ((types[0], inter, hidden), (types[1], inter, hidden), (types[2], hidden, inter))]
    return [torch.from_numpy(s) for s in stacks]


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q8_0", "Q4_1"), ("Q4_0", "Q6_K", "Q5_K")],
                         ids=["q4_k_m", "mixed", "legacy-gate"])
def test_a_layer_s_cpu_experts_in_one_call_equal_their_reference(lib, types):
    """Pairs of 5 tokens over 6 experts (one expert with 3 tokens, one unused, a token
    twice at different experts): gate/up, SiLU-and-mul and down per expert, summed into
    out with the router weights; the vector and plain C builds agree, at 1 and 2
    threads, and the call adds to what ``out`` held."""
    hidden, inter = 512, 256
    gate, up, down = _experts(types, 6, hidden, inter, seed=len(types[0]))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, hidden, generator=gen)
    tokens = torch.tensor([0, 1, 2, 3, 4, 0, 2, 4])
    experts = torch.tensor([3, 3, 3, 0, 5, 1, 4, 1])
    weights = torch.rand(8, generator=gen)
    for bits in ("16", "8"):
        with using(cpu_kquant_act_bits=bits):
            want = moe_experts_ref(x, tokens, experts, weights, gate, up, down, types)
            scale = float(want.abs().max())
            for scalar in (False, True):
                for threads in (1, 2):
                    got = moe_experts(lib, x, tokens, experts, weights, gate, up, down, types, threads=threads,
                                      scalar=scalar)
                    assert got.shape == (5, hidden) and got.dtype == torch.float32
                    assert float((got - want).abs().max()) <= 1e-5 * scale, (bits, scalar, threads)
            base = torch.ones(5, hidden)
            moe_experts(lib, x, tokens, experts, weights, gate, up, down, types, out=base)
            assert float((base - 1 - want).abs().max()) <= 1e-5 * scale, bits


@pytest.mark.parametrize("router_bias", [False, True], ids=["router", "router-bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
@pytest.mark.parametrize("interleave", [False, True], ids=["file", "x16"])
def test_the_call_that_routes_too_equals_route_then_the_experts(lib, renormalize, interleave, router_bias):
    """The router's weights in, its logits and each token's top 3 of 6 experts picked and
    weighted in C (:func:`~kernels.moe.reference.route`'s rule), 5 tokens (one whose
    logits favour experts 4 and 5 by far): within float32 order of the reference and of
    :func:`moe_experts` on ``route``'s pairs, at 1 and 2 threads."""
    from kernels.cpu import rows16
    from kernels.cpu.moe_experts import moe_experts_routed, moe_experts_routed_ref
    from kernels.moe.reference import route

    types = ("Q4_K", "Q4_K", "Q6_K")
    stacks = _experts(types, 6, 512, 256, seed=11)
    if interleave:
        if not rows16.available(lib):
            pytest.skip("the build has no AVX-512: no interleaved products")
        stacks, types = _interleaved(stacks, types, (0, 1, 2))
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 512, generator=gen)
    router = torch.randn(6, 512, generator=gen) * 0.1
    bias = torch.randn(6, generator=gen) if router_bias else None
    router[4:] += 0.5 * x[2] / x[2].norm()  # token 2 leans on experts 4 and 5
    want = moe_experts_routed_ref(x, router, bias, 3, renormalize, *stacks, types)
    weights, ids = route(torch.nn.functional.linear(x, router, bias), 3, renormalize)
    assert set(ids[2, :2].tolist()) == {4, 5}
    pairs = moe_experts(lib, x, torch.arange(5).repeat_interleave(3), ids.reshape(-1), weights.reshape(-1), *stacks,
                        types)
    scale = float(want.abs().max())
    for threads in (1, 2):
        got = moe_experts_routed(lib, x, router, bias, 3, renormalize, *stacks, types, threads=threads)
        assert got.shape == (5, 512) and got.dtype == torch.float32
        # h rounded to a neighbouring code of its block moves a sum by ~1e-5 of the scale
        # here: moe_experts on the same pairs is as far from the reference
        assert float((got - want).abs().max()) <= 5e-5 * scale, threads
        assert float((got - pairs).abs().max()) <= 1e-5 * scale, threads
    with pytest.raises(ValueError, match="top_k 0"):
        moe_experts_routed(lib, x, router, bias, 0, renormalize, *stacks, types)
    with pytest.raises(ValueError, match="top_k 7"):
        moe_experts_routed(lib, x, router, bias, 7, renormalize, *stacks, types)
    with pytest.raises(ValueError, match=r"router \(5, 512\)"):
        moe_experts_routed(lib, x, router[:5], None, 3, renormalize, *stacks, types)


def test_the_one_call_refuses_what_it_cannot_take(lib):
    gate, up, down = _experts(("Q4_K", "Q4_K", "Q6_K"), 2, 256, 256, seed=1)
    x = torch.randn(2, 256)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="the C kernels read"):
        moe_experts(lib, x, one, one, torch.ones(1), gate, up, down, ("Q5_0", "Q4_K", "Q6_K"))
    with pytest.raises(ValueError, match="an expert outside 0..1"):
        moe_experts(lib, x, one, torch.tensor([2]), torch.ones(1), gate, up, down, ("Q4_K", "Q4_K", "Q6_K"))
    with pytest.raises(ValueError, match="gate experts"):
        moe_experts(lib, torch.randn(2, 512), one, one, torch.ones(1), gate, up, down, ("Q4_K", "Q4_K", "Q6_K"))
    empty = moe_experts(lib, x, one[:0], one[:0], torch.ones(0), gate, up, down, ("Q4_K", "Q4_K", "Q6_K"))
    assert torch.equal(empty, torch.zeros(2, 256))


def test_the_cost_model_times_the_c_run(lib):
    """With the kernels, the measured CPU run is theirs over the blocks (positive, more
    tokens no cheaper)."""
    from engine.layers.moe.expert_costs import measure_stack_costs
    from engine.layers.moe.expert_stacks import BlockStack

    gate, up, down = _experts(("Q4_K", "Q4_K", "Q6_K"), 2, 256, 256, seed=2)
    stack = BlockStack(gate, up, down, ("Q4_K", "Q4_K", "Q6_K"))
    costs = measure_stack_costs(stack, torch.device("cpu"), repeats=1, cpu_kernels=lib)
    assert costs.expert_bytes == sum(t[0].nbytes for t in (gate, up, down))
    assert costs.cpu_s(256) >= costs.cpu_s(1) > 0


def _interleaved(stacks, types, which):
    """The stacks with those of ``which`` (indices) interleaved by 16 rows per expert, and
    their type names (``Q4_Kx16``...)."""
    from kernels.cpu import rows16
    from kernels.cpu.moe_experts import interleave_stack

    names = tuple(t + rows16.SUFFIX if i in which else t for i, t in enumerate(types))
    return [interleave_stack(s, t) if i in which else s for i, (s, t) in enumerate(zip(stacks, types, strict=True))], names


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q8_0", "Q4_1"), ("Q4_0", "Q6_K", "Q5_K")],
                         ids=["q4_k_m", "mixed", "legacy-gate"])
@pytest.mark.parametrize("which", [(0, 1, 2), (1,), (0, 2)], ids=["all", "up", "gate-down"])
def test_experts_interleaved_by_16_rows_equal_their_reference(lib, types, which):
    """Each expert's rows interleaved by 16 (the CPU engine's layout) for all three
    projections or some of them: 7 pairs of 3 tokens over 5 experts (one with 3 pairs,
    one unused, the others 1 or 2); within float32 summation order of gguf's dequantizer
    times the activations, at 1 and 2 threads and both activation-bit settings
    (interleaved blocks take 16-bit codes under either), and of the file's layout."""
    from kernels.cpu import rows16
    from kernels.cpu.moe_experts import file_stack

    if not rows16.available(lib):
        pytest.skip("the build has no AVX-512: no interleaved products")
    hidden, inter = 512, 256 if types[2] in KQUANTS else 96  # down's rows: whole blocks
    stacks = _experts(types, 5, hidden, inter, seed=7)
    stacks16, names = _interleaved(stacks, types, which)
    for s, s16, t in zip(stacks, stacks16, names, strict=True):
        assert torch.equal(file_stack(s16, t), s)  # the same bytes, reordered
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, hidden, generator=gen)
    tokens = torch.tensor([0, 1, 2, 0, 2, 1, 0])
    experts = torch.tensor([4, 4, 4, 0, 1, 3, 1])
    weights = torch.rand(7, generator=gen)
    for bits in ("8", "16"):
        with using(cpu_kquant_act_bits=bits):
            want = moe_experts_ref(x, tokens, experts, weights, *stacks16, names)
            scale = float(want.abs().max())
            for threads in (1, 2):
                got = moe_experts(lib, x, tokens, experts, weights, *stacks16, names, threads=threads)
                assert got.shape == (3, hidden) and got.dtype == torch.float32
                assert float((got - want).abs().max()) <= 1e-5 * scale, (bits, threads)
    with using(cpu_kquant_act_bits="16"):  # the file's layout on 16-bit codes: the same sums to float32 order
        plain = moe_experts(lib, x, tokens, experts, weights, *stacks, types)
        assert float((plain - want).abs().max()) <= 1e-5 * scale


def test_experts_interleave_only_in_whole_groups_of_16_rows(lib):
    """Experts of 40 rows do not interleave; a type without interleaved blocks is refused."""
    from kernels.cpu.moe_experts import interleave_stack

    stack = torch.from_numpy(random_blocks("Q8_0", 2 * 40, 64, np.random.default_rng(4)).reshape(2, 40, -1))
    with pytest.raises(ValueError, match="multiples of 16"):
        interleave_stack(stack, "Q8_0")
    gate, up, down = _experts(("MXFP4", "Q8_0", "Q8_0"), 2, 64, 64, seed=4)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="the C kernels read"):
        moe_experts(lib, torch.randn(1, 64), one, one, torch.ones(1), gate, up, down, ("MXFP4x16", "Q8_0", "Q8_0"))


def test_the_experts_bench_runs_each_path_on_fresh_routings(lib):
    """``python -m engine.bench.cpu_experts`` on a small shape: a row a path and token
    count, the interleaved one in the engine's own layout (its types renamed) where the
    build multiplies it."""
    import subprocess
    import sys

    from engine.bench.cpu_experts import interleaved, random_experts
    from kernels.cpu import rows16

    got = interleaved(lib, random_experts(("Q4_K", "Q4_K", "Q6_K"), 3, 256, 256), ("Q4_K", "Q4_K", "Q6_K"))
    if rows16.available(lib):
        assert got[1] == ("Q4_Kx16", "Q4_Kx16", "Q6_Kx16") and got[0][0].shape[:2] == (3, 256)
    else:
        assert got is None
    out = subprocess.run([sys.executable, "-m", "engine.bench.cpu_experts", "--tokens", "1", "2", "--experts", "6",
                          "--hidden", "256", "--intermediate", "256", "--top-k", "2", "--repeats", "2",
                          "--threads", "1", "--rows16"], capture_output=True, text=True, check=True).stdout
    paths = ["C kernels", "torch dequantize"] + (["C kernels, x16"] if rows16.available(lib) else [])
    for t in (1, 2):
        for path in paths:
            assert f"  {t} token(s), {path:16s}:" in out, out
    assert "GB/s of blocks" in out
