"""The fused mixture-of-experts kernel against its torch reference, the token-to-expert
sort it runs over, and the router against transformers' routers.

Without a GPU the Triton kernel runs in Triton's interpreter on small shapes (see
``triton_interpret.py``); with one, compiled on CUDA. Its sm_90 build is checked by
``test_kernels.py::test_kernels_compile_for_hopper_without_a_gpu``.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import kernel_device

from kernels import dispatch
from kernels.moe import reference as moe


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


def _problem(tokens, experts, top_k, hidden, inter, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=g)
    if skew:  # most tokens pick expert 0 and 1: runs longer than one block, others empty
        logits[:, :2] += 4.0
    weights, ids = moe.route(logits, top_k, renormalize=True)
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_to_blocks_groups_rows_by_expert(block_m):
    ids = torch.tensor([[3, 0], [0, 2], [3, 0], [1, 3], [0, 3]])
    rows = ids.numel()
    sorted_rows, block_experts, num_padded = moe.align_to_blocks(ids, 5, block_m)
    assert sorted_rows.numel() == moe.padded_capacity(rows, 5, block_m)
    used = int(num_padded[0])
    assert used % block_m == 0
    flat = ids.reshape(-1)
    seen = []
    for b in range(used // block_m):
        block = sorted_rows[b * block_m : (b + 1) * block_m]
        real = block[block < rows]
        # Every real row of a block belongs to the block's expert, in row order.
        assert all(int(flat[r]) == int(block_experts[b]) for r in real)
        assert real.tolist() == sorted(real.tolist())
        seen += real.tolist()
    assert sorted(seen) == list(range(rows))
    assert (sorted_rows[used:] == rows).all()
    # Each expert that has rows starts its own block (4 experts used, expert 4 none).
    assert used == sum(-(-int((flat == e).sum()) // block_m) * block_m for e in range(5))


CASES = [  # tokens, experts, top_k, hidden, inter, skew
    (1, 8, 2, 32, 16, False),  # one decode token
    (5, 4, 2, 32, 48, False),  # widths that are not a power of two
    (37, 8, 3, 64, 32, True),  # skewed routing: runs of several blocks, empty experts
]


@pytest.mark.parametrize("block_m", [16, None])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,skew", CASES)
def test_triton_fused_moe_equals_reference_float32(dev, tokens, experts, top_k, hidden, inter, skew, block_m):
    from kernels.moe import triton_kernel as triton_moe

    x, wgu, wd, weights, ids = _problem(tokens, experts, top_k, hidden, inter, torch.float32, skew=skew)
    ref = moe.fused_moe(x, wgu, wd, weights, ids)
    out = triton_moe.fused_moe(*(t.to(dev) for t in (x, wgu, wd, weights, ids)), block_m=block_m).cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_triton_fused_moe_bfloat16_within_rounding(dev):
    """bfloat16: each product rounds as the reference's eager ops do; only the sum of
    a token's top-k outputs is rounded once here and once per expert there."""
    from kernels.moe import triton_kernel as triton_moe

    x, wgu, wd, weights, ids = _problem(9, 4, 2, 32, 32, torch.bfloat16, seed=3)
    weights = weights.to(torch.bfloat16)
    ref = moe.fused_moe(x, wgu, wd, weights, ids)
    out = triton_moe.fused_moe(*(t.to(dev) for t in (x, wgu, wd, weights, ids))).cpu()
    assert out.dtype == torch.bfloat16
    scale = float(ref.float().abs().max())
    assert float((out.float() - ref.float()).abs().max()) <= 2**-7 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_moe_takes_gpt_oss_biases_and_clamped_swiglu(dev, dtype):
    """gpt-oss's experts in the grouped GEMMs (no longer declined to the reference, so
    its decode can be captured): biases on both projections and the clamped SwiGLU,
    with the clamp biting, equal the reference (float32 to its order; bfloat16 within
    the top-k sum's rounding, as above)."""
    from kernels.activation.reference import ClampedSwiGLU
    from kernels.moe import triton_kernel as triton_moe
    from kernels.moe.reference import ExpertBiases

    x, wgu, wd, weights, ids = _problem(11, 6, 2, 48, 32, dtype, seed=5)
    weights = weights.to(dtype)
    gen = torch.Generator().manual_seed(6)
    biases = ExpertBiases(gate_up=torch.randn(6, 64, generator=gen).to(dtype), down=torch.randn(6, 48, generator=gen).to(dtype))
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)
    assert float((x[:1].float() @ wgu[0].float().t()).abs().max()) > 0.5  # the clamp bites
    ref = moe.fused_moe(x, wgu, wd, weights, ids, biases=biases, activation=act)
    out = triton_moe.fused_moe(*(t.to(dev) for t in (x, wgu, wd, weights, ids)),
                               biases=ExpertBiases(biases.gate_up.to(dev), biases.down.to(dev)), activation=act).cpu()
    scale = float(ref.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert out.dtype == dtype and float((out.float() - ref.float()).abs().max()) <= tol * scale


def test_dispatch_runs_the_reference_on_the_cpu():
    x, wgu, wd, weights, ids = _problem(6, 4, 2, 16, 16, torch.float32)
    assert torch.equal(dispatch.fused_moe(x, wgu, wd, weights, ids), moe.fused_moe(x, wgu, wd, weights, ids))


def test_empty_batch():
    x, wgu, wd, weights, ids = _problem(0, 4, 2, 16, 16, torch.float32)
    assert moe.fused_moe(x, wgu, wd, weights, ids).shape == (0, 16)


@pytest.mark.parametrize(
    "family,norm_topk_prob",
    [("qwen3_moe", False), ("qwen3_moe", True), ("olmoe", False), ("olmoe", True), ("mixtral", True)],
)
def test_route_equals_transformers_router(family, norm_topk_prob):
    transformers = pytest.importorskip("transformers")
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router

        cfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
        renormalize = True  # Mixtral's router always renormalizes
    else:
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        Router = Qwen3MoeTopKRouter if family == "qwen3_moe" else OlmoeTopKRouter
        config_cls = transformers.Qwen3MoeConfig if family == "qwen3_moe" else transformers.OlmoeConfig
        cfg = config_cls(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
        renormalize = norm_topk_prob
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(4)))
        x = torch.randn(11, 32, generator=torch.Generator().manual_seed(5))
        logits, ref_weights, ref_ids = router(x)
    weights, ids = moe.route(logits, cfg.num_experts_per_tok, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=0, atol=0)
