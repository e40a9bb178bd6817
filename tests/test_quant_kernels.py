"""The GGUF dequantize-GEMV and dequantize-GEMM Triton kernels against the torch
reference built on ``gguf``'s own dequantizers, for every block type kept quantized.

Shapes cover partial tiles: N odd and not a multiple of the row tile, K a whole number
of blocks but not of the kernels' K step (several blocks per step, split-K ranges of
unequal length), M below and above the row tiles. Without a GPU the kernels run in
Triton's interpreter (see ``triton_interpret.py``).

Compiling for sm_90 (no register spills): here for :data:`COMPILE_CHECK_TYPES` only, one
K-quant and one legacy type, GEMV and GEMM; every type takes minutes on a two-core CI
runner, so the full sweep runs with the GPU tests
(``tests/gpu/test_quant_gpu.py::test_every_block_type_compiles_for_hopper_without_register_spills``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interpret import kernel_device, run_compiler_script, skip_without_ptxas

from kernels.quant import reference
from kernels.quant.formats import FORMATS, REPACKED, block_format, tensor_bytes
from kernels.quant.gemm_tuning import GemmTiling
from kernels.quant.synthetic import random_blocks

# Every GGUF type kept quantized, and the layouts the loader repacks some into on CUDA.
TYPES = list(FORMATS) + list(REPACKED)
# Compiled for sm_90 on every run: one K-quant (256-element super-blocks, packed sub-block
# scales) and one legacy type (32-element blocks, one scale and min each).
COMPILE_CHECK_TYPES = ("Q4_K", "Q4_1")


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


def _case(type_name: str, m: int, n: int, blocks_k: int, dev: str, dtype=torch.float32, seed: int = 0):
    fmt = block_format(type_name)
    k = blocks_k * fmt.block_elements
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(random_blocks(type_name, n, k, rng)).to(dev)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to(dtype).to(dev)
    return x, w


def assert_matches(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, type_name: str) -> None:
    """Within float32 summation-order error of the reference for float32 inputs; for
    bfloat16 outputs, within a few bfloat16 ulps of the largest value. A wrong byte,
    nibble or scale is off by the weights themselves."""
    ref = reference.quant_matmul(x.float(), w, type_name)
    assert out.shape == ref.shape and out.dtype == x.dtype
    scale = float(ref.abs().max()) + 1e-6
    tol = (1e-5 if x.dtype == torch.float32 else 2**-6) * scale
    diff = float((out.float() - ref).abs().max())
    assert diff <= tol, f"{type_name}: max |diff| {diff:.3g} > {tol:.3g} (max |ref| {scale:.3g})"


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m,n,blocks_k,split_k", [(1, 7, 3, 1), (3, 21, 5, 2), (16, 5, 2, None), (6, 19, 3, 2)])
def test_gemv_matches_gguf_dequantize(dev, type_name, m, n, blocks_k, split_k):
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case(type_name, m, n, blocks_k, dev)
    out = triton_quant.quant_gemv(x, w, type_name, block_n=4, split_k=split_k, blocks_per_step=2, int8_dot=False)
    assert_matches(out, x, w, type_name)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m,n,blocks_k", [(17, 19, 3), (5, 33, 2)])
def test_gemm_matches_gguf_dequantize(dev, type_name, m, n, blocks_k):
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case(type_name, m, n, blocks_k, dev, seed=1)
    out = triton_quant.quant_gemm(x, w, type_name, block_m=16, tiling=GemmTiling(block_n=16))
    assert_matches(out, x, w, type_name)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K", "Q6_K_P"])
def test_bfloat16_activations(dev, type_name):
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case(type_name, 2, 9, 2, dev, dtype=torch.bfloat16, seed=2)
    assert_matches(triton_quant.quant_gemv(x, w, type_name, block_n=4, int8_dot=False), x, w, type_name)
    x, w = _case(type_name, 18, 9, 2, dev, dtype=torch.bfloat16, seed=3)
    assert_matches(triton_quant.quant_gemm(x, w, type_name, block_m=16, tiling=GemmTiling(block_n=16)), x, w, type_name)


def test_matmul_dispatches_by_rows(dev):
    from kernels.quant import triton_kernel as triton_quant

    for m in (triton_quant.gemv_max_rows(), triton_quant.gemv_max_rows() + 1):
        x, w = _case("Q8_0", m, 3, 1, dev, seed=m)
        assert_matches(triton_quant.quant_matmul(x, w, "Q8_0"), x, w, "Q8_0")


def test_blocks_of_the_wrong_width_are_refused(dev):
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case("Q4_0", 1, 3, 2, dev)
    with pytest.raises(ValueError, match="do not hold rows of K=32"):
        triton_quant.quant_gemv(x[:, :32], w, "Q4_0")
    with pytest.raises(ValueError, match="not kept quantized"):
        triton_quant.quant_gemv(x, w, "IQ2_XXS")
    with pytest.raises(TypeError, match="unexpected GEMV tiling arguments: block_m"):
        triton_quant.quant_gemv(x, w, "Q4_0", block_m=4)


@pytest.mark.parametrize("type_name", TYPES)
def test_tensor_bytes_is_the_file_size(type_name):
    fmt = block_format(type_name)
    blocks = random_blocks(type_name, 3, 2 * fmt.block_elements, np.random.default_rng(0))
    assert tensor_bytes(type_name, (3, 2 * fmt.block_elements), 2) == blocks.nbytes
    assert tensor_bytes("F32", (3, 64), 2) == 3 * 64 * 2


@pytest.mark.parametrize("m,split_k", [(2, 1), (2, 3), (20, None)])
def test_output_into_a_column_slice(dev, m, split_k):
    """A fused projection of mixed types writes each part's columns of one output."""
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case("Q5_1", m, 6, 3, dev, seed=4)
    wide = torch.full((m, 10), 7.0, device=dev)
    if m <= triton_quant.gemv_max_rows():
        got = triton_quant.quant_gemv(x, w, "Q5_1", block_n=4, split_k=split_k, out=wide[:, 2:8])
    else:
        got = triton_quant.quant_gemm(x, w, "Q5_1", block_m=16, tiling=GemmTiling(block_n=16), out=wide[:, 2:8])
    assert got.data_ptr() == wide[:, 2:8].data_ptr()
    assert_matches(wide[:, 2:8], x, w, "Q5_1")
    assert bool((wide[:, :2] == 7).all() and (wide[:, 8:] == 7).all())


def test_kernels_compile_for_hopper_without_register_spills():
    """The GEMV (1 and 16 rows) and GEMM (bfloat16, float32) of :data:`COMPILE_CHECK_TYPES`
    compile for sm_90 with no stack frame, in a child process (see
    ``triton_quant_compile_check.py``): a spilling kernel makes the driver reserve its
    frame for every thread the GPU can hold, memory the plan never sees. The other block
    types are compiled by the GPU tests' sweep (minutes on two cores)."""
    skip_without_ptxas()
    done = run_compiler_script("triton_quant_compile_check.py", timeout=900, args=COMPILE_CHECK_TYPES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "quant kernels ok" in done.stdout
    for type_name in COMPILE_CHECK_TYPES:
        assert f"gemv {type_name} " in done.stdout and f"gemm {type_name} " in done.stdout


def test_q6k_planes_hold_the_same_bytes_and_turn_back(dev):
    """The repacked layout is a permutation of each row's bytes (same size: the plan's
    price holds), turns back exactly, can be made in place, and its fields start where
    the kernels read them."""
    from kernels.quant.repack import planes_to_q6k, q6k_to_planes, repackable, repacked_type

    w = torch.from_numpy(random_blocks("Q6_K", 5, 4 * 256, np.random.default_rng(9)))
    planes = q6k_to_planes(w)
    assert planes.shape == w.shape and not torch.equal(planes, w)
    assert torch.equal(planes.sort(dim=1).values, w.sort(dim=1).values)
    assert torch.equal(planes_to_q6k(planes), w)
    inplace = w.clone()
    assert q6k_to_planes(inplace, out=inplace) is inplace and torch.equal(inplace, planes)
    blocks = w.reshape(5, 4, 210)
    assert torch.equal(planes[:, 128 * 2 : 128 * 3], blocks[:, 2, :128])  # block 2's ql
    assert torch.equal(planes[:, 4 * 128 + 64 : 4 * 128 + 128], blocks[:, 1, 128:192])  # block 1's qh
    assert torch.equal(planes[:, 4 * 208 + 6 : 4 * 208 + 8], blocks[:, 3, 208:210])  # block 3's d
    assert repacked_type("Q6_K") == "Q6_K_P" and repacked_type("Q4_K") is None
    assert repackable("Q6_K", w) and not repackable("Q6_K", w[:, : 3 * 210]) and not repackable("Q4_K", w)
    with pytest.raises(ValueError, match="Q6_K rows"):
        q6k_to_planes(w[:, :100])
