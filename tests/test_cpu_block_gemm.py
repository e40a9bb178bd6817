"""The AVX-512 block GEMM of the C CPU kernels (kernels/cpu/block_gemm.c; the K-quants'
kernels/cpu/kquant_gemm.c) against its reference (gguf's dequantizer times the 16-bit activation codes, kernels/cpu/block_gemv.py)
on odd shapes, beside the AVX2 tile it replaces (the ``cpu_block_gemm`` switch off) and an
AVX2 build of the same sources; the activation codes against theirs."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from test_cpu_kernels import _tolerance  # noqa: E402

from engine.layers.linear.cpu_blocks import GEMM_ROWS, CpuBlockLinear  # noqa: E402
from kernels.cpu import build  # noqa: E402
from kernels.cpu.block_gemv import (  # noqa: E402
    TYPE_IDS,
    block_gemv,
    block_gemv_ref,
    gemm_on_blocks,
    quantize_rows,
    quantize_rows_ref,
)
from kernels.quant.synthetic import random_blocks  # noqa: E402
from kernels.switches import using  # noqa: E402

# (weight rows, K, activation rows): rows not a multiple of the tiles (8 and 4 weight
# rows, 6 activation rows), K of one block, prefill's many rows.
SHAPES = [(13, 32, 7), (21, 96, 13), (5, 64, 1), (130, 576, 70), (8, 1536, 6), (3, 64, 2)]


def _case(type_name: str, rows: int, cols: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks ``[rows, bytes]`` and activations ``[m, cols]`` with an outlier."""
    blocks = torch.from_numpy(random_blocks(type_name, rows, cols, np.random.default_rng(rows * cols + m)))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(rows + m))
    x[0, 3] = 40.0  # a block with an outlier, as real activations have
    return blocks, x


def _check(lib: ctypes.CDLL, type_name: str, rows: int, cols: int, m: int) -> None:
    blocks, x = _case(type_name, rows, cols, m)
    got = block_gemv(lib, x, blocks, type_name)
    assert got.shape == (m, rows)
    assert float((got - block_gemv_ref(x, blocks, type_name)).abs().max()) <= _tolerance(x, blocks, type_name)


@pytest.mark.parametrize("type_name", list(TYPE_IDS))
@pytest.mark.parametrize(("rows", "cols", "m"), SHAPES)
@pytest.mark.parametrize("block_gemm", [True, False])
def test_the_block_gemm_and_the_avx2_tile_equal_their_reference(lib, type_name, rows, cols, m, block_gemm):
    with using(cpu_block_gemm=block_gemm):
        _check(lib, type_name, rows, cols, m)


KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
# K-quant shapes: weight rows past whole tiles of 8 and of 4 (and fewer than 4), K of one
# super-block and of three, 1 to 7 activation rows (the tile's 6 and one more pass).
KQUANT_SHAPES = [(15, 256, 1), (9, 768, 2), (3, 256, 3), (20, 512, 4), (13, 256, 5), (8, 768, 6), (22, 256, 7)]


def _paths(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, type_name: str) -> dict[str, torch.Tensor]:
    """The product by each path the build has: the block GEMM tile (the switch on), the
    AVX2 one (off) and plain C."""
    out = {"plain C": block_gemv(lib, x, blocks, type_name, scalar=True)}
    for on in (True, False):
        with using(cpu_block_gemm=on):
            out["block GEMM" if on else "AVX2"] = block_gemv(lib, x, blocks, type_name)
    return out


@pytest.mark.parametrize("type_name", KQUANTS)
@pytest.mark.parametrize(("rows", "cols", "m"), KQUANT_SHAPES)
def test_the_kquant_tiles_equal_gguf_s_dequantizer_times_the_codes(lib, type_name, rows, cols, m):
    """Q4_K/Q5_K/Q6_K (kquant_gemm.c's tile, kquant.c's AVX2 row and plain C) against
    gguf's dequantized weights times the 16-bit activation codes, within float32
    summation order."""
    blocks, x = _case(type_name, rows, cols, m)
    want, tol = block_gemv_ref(x, blocks, type_name), _tolerance(x, blocks, type_name)
    for path, got in _paths(lib, x, blocks, type_name).items():
        assert got.shape == (m, rows) and got.dtype == torch.float32
        assert float((got - want).abs().max()) <= tol, path


def test_the_activation_codes_are_the_reference_s(lib):
    """The vector quantizer's codes, scales and sums are the reference's exactly: ties
    (x / dx a half) rounded to even, an outlier block, an all-zero block, a tiny one."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 256)
    x[0, :32] = torch.arange(32) - 15.5  # halves: ties once the scale is 1
    x[0, 0] = 32767.0
    x[1, 40] = 1e4
    x[2, 64:96] = 0.0
    x[3, 96:128] = 1e-20
    codes, scales, sums = quantize_rows(lib, x)
    want_codes, want_scales = quantize_rows_ref(x)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert torch.equal(sums, want_codes.view(6, 8, 32).sum(-1, dtype=torch.int32))


def test_many_rows_take_the_block_gemm_where_the_build_has_it(lib):
    """With AVX-512, a prefill's rows are multiplied on the blocks (the reference's
    products, not the float32 GEMM's); the switch off, by the float32 GEMM."""
    if lib.hr_simd_level() < 2:
        pytest.skip("this build has no AVX-512 block GEMM")
    assert gemm_on_blocks(lib)
    blocks = torch.from_numpy(random_blocks("Q4_1", 40, 96, np.random.default_rng(4)))
    linear = CpuBlockLinear(lib, 96, [("Q4_1", blocks)], None)
    x = torch.randn(GEMM_ROWS + 5, 96)
    assert torch.equal(linear(x), block_gemv(lib, x, blocks, "Q4_1"))
    with using(cpu_block_gemm=False):
        assert not gemm_on_blocks(lib)
        assert not torch.equal(linear(x), block_gemv(lib, x, blocks, "Q4_1"))


def test_an_avx2_build_of_the_same_sources_is_correct(lib, tmp_path):
    """Where the CPU has AVX2 and no AVX-512 (built here with -mno-avx512f): the AVX2
    tile and the plain C quantizer, against the reference."""
    if lib.hr_simd_level() < 2:
        pytest.skip("the engine's own build is this CPU's AVX2 one (test_cpu_kernels.py)")
    avx2 = build.build_variant(tmp_path, ("-mno-avx512f",))
    assert avx2.hr_simd_level() == 1
    for type_name in TYPE_IDS:
        _check(avx2, type_name, 21, 96, 13)
    for type_name in KQUANTS:
        _check(avx2, type_name, 21, 256, 7)
