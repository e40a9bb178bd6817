"""The Triton fused mixture of experts over GGUF blocks (grouped GEMV for decode, sorted
GEMM for prefill) against the torch reference, which loops over the experts and
dequantizes each through ``gguf``, for every block type kept quantized.

Shapes cover partial tiles (a projection's rows not a multiple of the program's rows,
clamped and masked), K a few blocks, gate, up and down of different types as a Q4_K_M
file holds them, top-2 of 4 to 8 experts, and 1, 3 (the GEMV) and 37 tokens (the GEMM,
whose sort pads each expert's rows). Without a GPU the kernels run in Triton's
interpreter (see ``triton_interpret.py``), on float32 activations: the two sides then
differ by float32 summation order only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interpret import kernel_device, run_compiler_script, skip_without_ptxas

from kernels.moe import quant_reference as moe_reference
from kernels.moe.reference import route
from kernels.quant.formats import FORMATS, block_format
from kernels.quant.synthetic import random_blocks

# Weight rows per program: 64 leaves a partial tile on the 96-row projections below.
BLOCK_N = 64


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


def _dims(types: tuple[str, str, str]) -> tuple[int, int]:
    """``(H, I)``: two blocks of the gate/up type along H and whole blocks of the down's
    along I; 96 (three 32-weight blocks) where a dimension's type allows it, so its
    projection's rows end in a partial tile."""
    h = 96 if max(block_format(t).block_elements for t in types[:2]) == 32 else 2 * 256
    i = 96 if block_format(types[2]).block_elements == 32 else 256
    return h, i


def _case(types, tokens: int, experts: int, dev: str, seed: int = 0, dtype=torch.float32, dims=None):
    h, i = dims or _dims(types)
    rng = np.random.default_rng(seed)

    def stack(type_name, rows, cols):
        blocks = [random_blocks(type_name, rows, cols, rng, scale=1e-3) for _ in range(experts)]
        return torch.from_numpy(np.stack(blocks)).to(dev)

    w = (stack(types[0], i, h), stack(types[1], i, h), stack(types[2], h, i))
    x = torch.from_numpy(rng.standard_normal((tokens, h), dtype=np.float32)).to(dtype).to(dev)
    logits = torch.from_numpy(rng.standard_normal((tokens, experts), dtype=np.float32)).to(dev)
    weights, ids = route(logits, 2, renormalize=True)
    return x, w, weights.to(dtype), ids


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = float(ref.abs().max()) + 1e-6
    diff = float((out.float() - ref.float()).abs().max())
    assert diff <= rel * scale, f"max |diff| {diff:.3g} > {rel * scale:.3g} (max |ref| {scale:.3g})"


def _run(types, tokens, experts, dev, method, seed=0):
    from kernels.moe import quant_triton_kernel as triton_moe_quant

    x, (wg, wu, wd), weights, ids = _case(types, tokens, experts, dev, seed)
    ref = moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids)
    out = triton_moe_quant.fused_moe_quant(x, wg, wu, wd, types, weights, ids, method=method, block_n=BLOCK_N,
                                           block_m=16)
    assert_matches(out, ref, 1e-5)


@pytest.mark.parametrize("type_name", list(FORMATS))
@pytest.mark.parametrize("tokens,method", [(1, "gemv"), (3, "gemv"), (37, "gemm")])
def test_one_type_per_layer_matches_the_reference(dev, type_name, tokens, method):
    _run((type_name,) * 3, tokens, 4, dev, method)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q6_K"), ("Q5_K", "Q4_K", "Q5_1")],
                         ids="-".join)
@pytest.mark.parametrize("tokens,method", [(3, "gemv"), (37, "gemm")])
def test_a_type_per_projection_matches_the_reference(dev, types, tokens, method):
    """Gate, up and down each of their own type (a Q4_K_M file's Q4_K gate/up and Q6_K
    down; legacy and K-quant types mixed), over 8 experts."""
    _run(types, tokens, 8, dev, method, seed=1)


@pytest.mark.parametrize("packed", [True, False])
def test_the_sorted_gemm_decodes_k_quants_as_the_packed_gemm(dev, packed):
    """The sorted GEMM's Q4_K and Q5_K experts go through the packed GEMM's decode
    (:func:`kernels.quant.triton_packed_gemm.packed_dot`; its float32 twin in the
    interpreter, the PTX on bfloat16 rows on a GPU) with the ``quant_gemm_packed`` switch
    on, the float tile decode with it off; both equal the reference, and a layer mixing
    them with a Q6_K down (which the float decode keeps) too."""
    from kernels.switches import using

    with using(quant_gemm_packed=packed):
        _run(("Q4_K", "Q5_K", "Q6_K"), 37, 8, dev, "gemm", seed=2)
        _run(("Q5_K", "Q5_K", "Q5_K"), 21, 4, dev, "gemm", seed=3)


def test_default_method_by_tokens(dev):
    """The GEMV up to GEMV_MAX_TOKENS tokens and the GEMM above agree with the reference
    without a forced tiling."""
    from kernels.moe import quant_triton_kernel as triton_moe_quant

    types = ("Q8_0", "Q8_0", "Q8_0")
    for tokens in (triton_moe_quant.GEMV_MAX_TOKENS, triton_moe_quant.GEMV_MAX_TOKENS + 1):
        # An intermediate size of one block (a third of the programs and K steps of 96);
        # the down projection's 96 rows still end in a partial tile of the default GEMM's.
        x, (wg, wu, wd), weights, ids = _case(types, tokens, 4, dev, seed=tokens, dims=(96, 32))
        out = triton_moe_quant.fused_moe_quant(x, wg, wu, wd, types, weights, ids)
        assert_matches(out, moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids), 1e-5)


def test_bfloat16_activations(dev):
    """bfloat16 activations: the reference rounds the dequantized weights to bfloat16 and
    the kernels do not, so they agree to a few bfloat16 ulps of the largest output."""
    from kernels.moe import quant_triton_kernel as triton_moe_quant

    types = ("Q4_K", "Q4_K", "Q6_K")
    for tokens, method in ((2, "gemv"), (18, "gemm")):
        x, (wg, wu, wd), weights, ids = _case(types, tokens, 4, dev, seed=5, dtype=torch.bfloat16)
        out = triton_moe_quant.fused_moe_quant(x, wg, wu, wd, types, weights, ids, method=method, block_n=BLOCK_N)
        assert_matches(out, moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids), 2**-5)


def test_blocks_of_another_type_are_refused(dev):
    from kernels.moe import quant_triton_kernel as triton_moe_quant

    x, (wg, wu, wd), weights, ids = _case(("Q8_0",) * 3, 1, 4, dev)
    with pytest.raises(ValueError, match="down experts: want Q4_0 blocks"):
        triton_moe_quant.fused_moe_quant(x, wg, wu, wd, ("Q8_0", "Q8_0", "Q4_0"), weights, ids)
    with pytest.raises(ValueError, match="method must be"):
        triton_moe_quant.fused_moe_quant(x, wg, wu, wd, ("Q8_0",) * 3, weights, ids, method="loop")


def test_kernels_compile_for_hopper_without_register_spills():
    """The grouped GEMV and the sorted GEMM, gated and weighted, for Q4_K/Q4_K/Q6_K and
    Q8_0 experts, compile for sm_90 with no stack frame, in a child process (see
    ``triton_moe_quant_compile_check.py``): the interpreter accepts code the compiler
    refuses, and a spilling kernel makes the driver reserve memory the plan never sees."""
    skip_without_ptxas()
    done = run_compiler_script("triton_moe_quant_compile_check.py", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "moe quant kernels ok" in done.stdout
    assert "moe gemv Q4_K/Q4_K gate/up" in done.stdout and "moe gemm Q6_K/Q6_K down" in done.stdout


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q4_0")], ids="-".join)
@pytest.mark.parametrize("tokens,method", [(3, "gemv"), (37, "gemm")])
def test_cached_experts_are_read_from_their_slots(dev, types, tokens, method):
    """With an expert cache, an expert with a slot is read from the cache's stacks, the
    others from the layer's: the cache below holds *other* experts' weights in its slots,
    so a kernel reading the wrong source gives another answer. On a GPU the layer's
    stacks may be pinned host memory read over the bus (tests/gpu); the arithmetic is this."""
    from kernels.moe import quant_triton_kernel as triton_moe_quant

    x, (wg, wu, wd), weights, ids = _case(types, tokens, 8, dev, seed=7)
    _, cache, _, _ = _case(types, 1, 3, dev, seed=8)  # 3 slots of unrelated experts
    slot_of = torch.full((8,), -1, dtype=torch.int64, device=ids.device)
    slot_of[int(ids[0, 0])], slot_of[int(ids[1, 1])] = 2, 0
    ref = moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids, cache=cache, slot_of=slot_of)
    out = triton_moe_quant.fused_moe_quant(x, wg, wu, wd, types, weights, ids, cache=cache, slot_of=slot_of,
                                           method=method, block_n=BLOCK_N, block_m=16)
    assert_matches(out, ref, 1e-5)
    plain = moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids)
    assert float((plain - ref).abs().max()) > 1e-3 * float(ref.abs().max())  # the slots did change the answer
    with pytest.raises(ValueError, match="needs slot_of"):
        moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids, cache=cache)
    with pytest.raises(ValueError, match="is not int64"):
        triton_moe_quant.fused_moe_quant(x, wg, wu, wd, types, weights, ids, cache=cache, slot_of=slot_of[:4])


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q4_0")], ids="-".join)
@pytest.mark.parametrize("tokens,method", [(3, "gemv"), (37, "gemm")])
def test_skipped_experts_are_neither_read_nor_added(dev, types, tokens, method):
    """``slot_of`` -2 (``SKIP_SLOT``: the CPU runs that expert's pairs) beside slots and
    bus reads: the kernels give the reference over the other pairs. The skipped experts'
    blocks are all 0xFF bytes (NaN scales), so a kernel that read them and multiplied by
    a zero weight would give NaN: they are not read at all."""
    from kernels.moe import quant_triton_kernel as triton_moe_quant

    x, (wg, wu, wd), weights, ids = _case(types, tokens, 8, dev, seed=9)
    _, cache, _, _ = _case(types, 1, 2, dev, seed=10)
    skipped = sorted({int(ids[0, 0]), int(ids[1, 1])})
    cached = next(e for e in ids.flatten().tolist() if e not in skipped)
    slot_of = torch.full((8,), -1, dtype=torch.int64, device=ids.device)
    slot_of[cached] = 1
    others = weights.masked_fill(torch.isin(ids, torch.tensor(skipped, device=ids.device)), 0)
    clean_ref = moe_reference.fused_moe_quant(x, wg, wu, wd, types, others, ids, cache=cache, slot_of=slot_of)
    slot_of[skipped] = moe_reference.SKIP_SLOT
    for w in (wg, wu, wd):
        w[skipped] = 0xFF
    ref = moe_reference.fused_moe_quant(x, wg, wu, wd, types, weights, ids, cache=cache, slot_of=slot_of)
    assert torch.equal(ref, clean_ref)  # the reference reads nothing of a skipped expert either
    out = triton_moe_quant.fused_moe_quant(x, wg, wu, wd, types, weights, ids, cache=cache, slot_of=slot_of,
                                           method=method, block_n=BLOCK_N, block_m=16)
    assert not out.isnan().any()
    assert_matches(out, ref, 1e-5)
