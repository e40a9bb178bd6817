"""The GGUF-block products above the GEMV's rows, in Triton's interpreter on the CPU (or
compiled on a GPU) against ``gguf``'s dequantizer: the tile GEMM with K split across
programs (batched decode), the weight dequantized whole (:mod:`kernels.quant.triton_dequant`)
and multiplied by torch (long prefill chunks), the dispatch between them by rows, and a
fused projection of mixed types taking one dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_kernels import TYPES, _case, assert_matches
from triton_interpret import kernel_device

from kernels.quant import reference
from kernels.quant.formats import block_format
from kernels.quant.gemm_tuning import GemmTiling
from kernels.quant.synthetic import random_blocks
from kernels.switches import using


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K_P", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("m,split_k", [(5, 2), (33, 3)])
def test_gemm_with_k_split_matches_gguf_dequantize(dev, type_name, m, split_k):
    """Partial sums of K ranges (float32) added in a fixed order, then written in the rows'
    dtype; 33 rows take a 64-row tile, most of it masked."""
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case(type_name, m, 19, 3, dev, seed=m)
    got = triton_quant.quant_gemm(x, w, type_name, tiling=GemmTiling(block_n=16), split_k=split_k)
    assert_matches(got, x, w, type_name)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K_P", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("m,n,split_k", [(5, 19, 2), (33, 70, 3), (16, 64, 1)])
def test_packed_gemm_matches_gguf_dequantize(dev, type_name, m, n, split_k, monkeypatch):
    """The packed GEMM (codes decoded four a register; in the interpreter its float32
    twin, on a GPU the PTX on bfloat16 rows) equals the reference: rows and weight rows
    that do not fill a tile, K split in ranges added in a fixed order; and it is what the
    block GEMM runs for bfloat16 rows on CUDA, or when its tiling is asked for."""
    from kernels.quant import triton_kernel as triton_quant
    from kernels.quant.triton_packed_gemm import packed_gemm

    # Q6_K_P rows of an even number of blocks (4-byte aligned: what the loader repacks)
    x, w = _case(type_name, m, n, 4 if type_name == "Q6_K_P" else 3, dev, seed=m)
    if dev == "cuda":
        x = x.to(torch.bfloat16)
    got = packed_gemm(x, w, type_name, block_m=16, block_n=16, split_k=split_k)
    assert_matches(got, x, w, type_name)
    tiling = GemmTiling(block_n=16, packed=True)
    assert torch.equal(triton_quant.quant_gemm(x, w, type_name, block_m=16, tiling=tiling, split_k=split_k), got)
    if dev == "cuda":
        calls = []
        monkeypatch.setattr(triton_quant, "packed_gemm", lambda *a, **kw: calls.append(kw) or packed_gemm(*a, **kw))
        assert_matches(triton_quant.quant_gemm(x, w, type_name, split_k=split_k), x, w, type_name)
        assert calls, "bfloat16 rows on CUDA take the packed GEMM"
        calls.clear()
        with using(quant_gemm_packed=False):
            triton_quant.quant_gemm(x, w, type_name, split_k=split_k)
        assert not calls


@pytest.mark.parametrize("split_k", [1, 2])
def test_packed_gemm_writes_a_column_slice(dev, split_k):
    """A fused projection's part writes its columns of a wider output: the packed GEMM
    fills exactly that slice (the columns around it untouched), K split or not."""
    from kernels.quant.triton_packed_gemm import packed_gemm

    x, w = _case("Q4_K", 20, 24, 2, dev, seed=split_k)
    if dev == "cuda":
        x = x.to(torch.bfloat16)
    wide = torch.full((20, 40), 7.0, device=dev, dtype=x.dtype)
    got = packed_gemm(x, w, "Q4_K", block_m=16, block_n=16, split_k=split_k, out=wide[:, 10:34])
    assert got.data_ptr() == wide[:, 10:34].data_ptr()
    assert_matches(wide[:, 10:34], x, w, "Q4_K")
    assert bool((wide[:, :10] == 7).all()) and bool((wide[:, 34:] == 7).all())


def test_the_packed_family_needs_aligned_k_quant_rows(monkeypatch):
    """Bfloat16 rows with the PTX on take the packed GEMM; a K-quant part whose rows start
    2 bytes off a 4-byte boundary (after a fused projection's part of 32-weight blocks)
    keeps the float tile GEMM, the 32-weight formats do not mind; the switch off, none."""
    from kernels.quant import triton_kernel as triton_quant
    from kernels.switches import using

    monkeypatch.setattr(triton_quant, "ptx_enabled", lambda device: True)
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    flat = torch.zeros(2 + 4 * 144, dtype=torch.uint8)
    aligned, off = flat[:4 * 144].view(4, 144), flat[2:].view(4, 144)
    assert off.data_ptr() % 4 == 2
    assert triton_quant._family(x, aligned, "Q4_K") == "packed"
    assert triton_quant._family(x, off, "Q4_K") == "float"
    assert triton_quant._family(x, flat[2:2 + 4 * 34].view(4, 34), "Q8_0") == "packed"
    assert triton_quant._family(x.half(), aligned, "Q4_K") == "float"
    with using(quant_gemm_packed=False):
        assert triton_quant._family(x, aligned, "Q4_K") == "float"


def test_packed_gemm_refuses_other_types_and_rows(dev):
    from kernels.quant.triton_packed_gemm import packed_gemm

    x, w = _case("Q5_0", 16, 16, 8, dev)
    with pytest.raises(ValueError, match="reads Q4_0, Q8_0, Q4_K, Q5_K, Q6_K_P, not Q5_0"):
        packed_gemm(x, w, "Q5_0")
    x, w = _case("Q6_K_P", 16, 16, 3, dev)  # 630-byte rows: scales not 4-byte aligned
    with pytest.raises(ValueError, match="4-byte aligned"):
        packed_gemm(x.to(torch.bfloat16) if dev == "cuda" else x, w, "Q6_K_P")
    x, w = _case("Q4_K", 16, 16, 1, dev)
    with pytest.raises(ValueError, match="powers of two"):
        packed_gemm(x.to(torch.bfloat16) if dev == "cuda" else x, w, "Q4_K", block_n=24)
    if dev == "cuda":
        with pytest.raises(ValueError, match="bfloat16 rows"):
            packed_gemm(x.half(), w, "Q4_K")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q6_K_P", "Q4_0", "Q5_1"])
@pytest.mark.parametrize("k_step", [32, 128, 512])
def test_gemm_k_steps_cross_blocks_and_ranges(dev, type_name, k_step):
    """A K step of a few sub-blocks, of part of a block, or of several blocks (32-weight
    formats take 16 blocks a step at 512, K split in ranges of 2 blocks): the step's
    weights laid flat in K's order, the sub-blocks past a range's end meeting zeroed
    activations."""
    from kernels.quant import triton_kernel as triton_quant

    x, w = _case(type_name, 18, 9, 5, dev, seed=k_step)
    tiling = GemmTiling(block_n=16, k_step=k_step)
    for split_k in (1, 3):
        assert_matches(triton_quant.quant_gemm(x, w, type_name, tiling=tiling, split_k=split_k), x, w, type_name)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf(dev, type_name):
    """Every weight of every type, in float32 as ``gguf`` gives it (float32 arithmetic on
    the same fields), in bfloat16 rounded once (on a GPU; Triton's interpreter truncates);
    written into a row range of a larger tensor, the rows around it untouched."""
    from kernels.quant.triton_dequant import dequantize

    k = 2 * block_format(type_name).block_elements
    w = torch.from_numpy(random_blocks(type_name, 19, k, np.random.default_rng(5))).to(dev)
    want = reference.dequantize(w, type_name, k)
    got = dequantize(w, type_name, k, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    whole = torch.full((23, k), 7.0, dtype=torch.bfloat16, device=dev)
    dequantize(w, type_name, k, torch.bfloat16, out=whole[2:21])
    if dev == "cuda":
        assert torch.equal(whole[2:21], want.to(torch.bfloat16))
    else:  # the interpreter truncates float32 to bfloat16 where the GPU rounds: within one ulp
        torch.testing.assert_close(whole[2:21].float(), want, rtol=2**-7, atol=0)
    assert bool((whole[:2] == 7).all() and (whole[21:] == 7).all())


def test_dequantize_refuses_a_wrong_output(dev):
    from kernels.quant.triton_dequant import dequantize

    x, w = _case("Q8_0", 1, 3, 2, dev)
    with pytest.raises(ValueError, match="out must be"):
        dequantize(w, "Q8_0", 64, torch.float32, out=torch.empty(3, 32, device=dev))
    with pytest.raises(ValueError, match="do not hold rows"):
        dequantize(w, "Q8_0", 96, torch.float32)


def test_matmul_takes_the_dequantized_weight_from_the_switchs_rows(dev, monkeypatch):
    """Up to ``quant_gemv_rows`` rows the GEMV, then the tile GEMM, from
    ``quant_dequant_rows`` the weight dequantized whole (0: never); each equals the
    reference (Q5_K: the float GEMV, not the int8 one), into a column slice too."""
    from kernels.quant import triton_dequant
    from kernels.quant import triton_kernel as triton_quant

    taken = []
    for name in ("quant_gemv", "quant_gemm"):
        monkeypatch.setattr(triton_quant, name, lambda *a, _f=getattr(triton_quant, name), _n=name, **k:
                            taken.append(_n) or _f(*a, **k))
    whole = triton_dequant.dequant_matmul
    monkeypatch.setattr(triton_dequant, "dequant_matmul", lambda *a, **k: taken.append("dequant") or whole(*a, **k))
    with using(quant_gemv_rows=2, quant_dequant_rows=6):
        for m, path in ((2, "quant_gemv"), (3, "quant_gemm"), (6, "dequant"), (9, "dequant")):
            x, w = _case("Q5_K", m, 5, 1, dev, seed=m)
            wide = torch.full((m, 9), 7.0, device=dev)
            triton_quant.quant_matmul(x, w, "Q5_K", out=wide[:, 1:6])
            assert taken.pop() == path and not taken
            assert_matches(wide[:, 1:6], x, w, "Q5_K")
            assert bool((wide[:, :1] == 7).all() and (wide[:, 6:] == 7).all())
    with using(quant_gemv_rows=2, quant_dequant_rows=0):
        x, w = _case("Q5_K", 9, 5, 1, dev)
        assert_matches(triton_quant.quant_matmul(x, w, "Q5_K"), x, w, "Q5_K")
        assert taken == ["quant_gemm"]


def test_a_fused_projection_of_mixed_types_dequantizes_one_weight_for_a_long_chunk(dev, monkeypatch):
    """q/k in Q4_K over v in Q6_K over a dense part: from ``quant_dequant_rows`` rows the
    layer decodes every part into one weight and multiplies once; it equals the parts
    multiplied apart by the reference."""
    from engine.layers.linear import gguf_blocks as quant_linear
    from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear

    if dev == "cpu":  # the Triton path, interpreted, on CPU tensors
        monkeypatch.setattr(quant_linear, "use_triton", lambda t: True)
    k = 256
    specs = [PartSpec(4, "Q4_K"), PartSpec(3, "Q6_K"), PartSpec(2, None)]
    layer = QuantLinear(k, specs, bias=False, dtype=torch.float32).to_empty(device=dev)
    rng = np.random.default_rng(0)
    for spec, buf in layer.part_views():
        if spec.type_name is None:
            buf.copy_(torch.from_numpy(rng.standard_normal(tuple(buf.shape), dtype=np.float32)))
        else:
            buf.copy_(torch.from_numpy(random_blocks(spec.type_name, spec.rows, k, rng)))
    x = torch.from_numpy(rng.standard_normal((7, k), dtype=np.float32)).to(dev)
    want = torch.cat([x @ buf.T if spec.type_name is None else reference.quant_matmul(x, buf, spec.type_name)
                      for spec, buf in layer.part_views()], dim=1)
    with using(quant_gemv_rows=2, quant_dequant_rows=7):
        assert layer._dequantizes_whole(x) and not layer._dequantizes_whole(x[:6])
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(layer(x[:6]), want[:6], rtol=1e-5, atol=1e-4)  # the GEMM, a part at a time


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q6_K_P", "Q4_1", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("groups,split_k", [(1, 1), (4, 3)])
def test_int8_gemm_equals_the_product_of_its_int8_activations(dev, type_name, groups, split_k):
    """The int8 tensor-core GEMM multiplies the activations as rounded to int8 per 32 by
    the weights as stored: it equals that product in float64 to float32 order, with K
    split in ranges and the loop's last step past a range's end; and it is what the
    block GEMM runs for 16-bit rows with the ``quant_gemm_int8`` switch on."""
    from kernels.quant import triton_kernel as triton_quant
    from kernels.quant.triton_activations import quantize_activations
    from kernels.quant.triton_int8_gemm import int8_gemm

    x, w = _case(type_name, 18, 9, 3, dev, seed=groups)
    q8 = quantize_activations(x)
    k = x.shape[1]
    rounded = (q8.codes.double().view(18, -1, 32) * q8.scales.double()[:, :, None]).view(18, k)
    want = rounded @ reference.dequantize(w, type_name, k).double().T
    got = int8_gemm(q8, w, type_name, block_m=16, block_n=16, groups=groups, split_k=split_k)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    tiling = GemmTiling(block_n=16, k_step=32 * groups, int8=True)
    from_x = triton_quant.quant_gemm(x, w, type_name, block_m=16, tiling=tiling, split_k=split_k)
    torch.testing.assert_close(from_x, got)
    x16 = x.to(torch.bfloat16)  # float32 rows keep the exact float GEMM
    with using(quant_gemm_int8=True):
        assert torch.equal(triton_quant.quant_gemm(x16, w, type_name, block_m=16, split_k=split_k),
                           int8_gemm(quantize_activations(x16), w, type_name, block_m=16, block_n=64, groups=4,
                                     split_k=split_k))
