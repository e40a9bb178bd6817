"""The int8-activation GEMV (:mod:`kernels.quant.triton_int8`) and the activations'
quantization (:mod:`kernels.quant.triton_activations`: the quantizing launch and the
norm and SiLU-and-mul kernels that quantize their output) against the torch references
of their arithmetic, and the GGUF projection's choices among them (the ``quant_int8*``
switches of :mod:`kernels.switches`). Without a GPU the kernels run in Triton's
interpreter (see ``triton_interpret.py``); shapes and helpers as
``test_quant_kernels.py``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_kernels import _case
from triton_interpret import kernel_device

from kernels.quant import reference
from kernels.quant.synthetic import random_blocks
from kernels.switches import using


@pytest.fixture(scope="module")
def dev() -> str:
    return kernel_device()


# How far the int8 GEMV may land from the exact product, as a share of the largest
# output: the activations are rounded to int8 per 32 values (error up to amax / 254 of
# each group); measured up to 1.8% on these random blocks, whose mins make every
# weight of a sub-block share a large offset.
INT8_ROUNDING_TOL = 0.05


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q6_K_P"])
@pytest.mark.parametrize("m,n,blocks_k,split_k,block_n,kb", [(1, 7, 3, 1, 4, 2), (3, 5, 5, 2, 4, 2),
                                                            (2, 9, 2, None, 8, 4), (16, 3, 1, None, 4, 2),
                                                            (1, 5, 3, 1, 1, 16)])
def test_int8_gemv_matches_its_reference(dev, type_name, m, n, blocks_k, split_k, block_n, kb):
    """The int8-activation GEMV equals the torch reference of its arithmetic (the
    activations rounded as the kernel rounds them, the exact weights) to float32
    summation order, and the exact product within the stated rounding tolerance; N
    not a multiple of the row tile, K ranges of unequal length, dead blocks in a step."""
    from kernels.quant import triton_activations, triton_int8
    from kernels.quant import triton_kernel as triton_quant

    if type_name == "Q6_K_P":  # its rows are read as 32-bit words: an even number of blocks
        blocks_k += blocks_k % 2
    x, w = _case(type_name, m, n, blocks_k, dev, seed=5)
    out = triton_quant.quant_gemv(x, w, type_name, block_n=block_n, split_k=split_k, blocks_per_step=kb,
                                  int8_dot=True)
    ref = reference.quant_matmul_int8(x, w, type_name)
    scale = float(ref.abs().max())
    assert float((out - ref).abs().max()) <= 1e-5 * scale
    exact = reference.quant_matmul(x, w, type_name)
    assert float((out - exact).abs().max()) <= INT8_ROUNDING_TOL * float(exact.abs().max())
    assert triton_quant.uses_int8_dot(type_name, True) and type_name in triton_int8.INT8_TYPES
    # The next step's words loaded ahead; for Q4_K the tiling where a thread holds whole
    # runs of a block, with and without.
    variants = [{"PREFETCH": 1}] + ([{"SPLIT": 1}, {"SPLIT": 1, "PREFETCH": 1}] if type_name == "Q4_K" else [])
    for variant in variants:
        got = triton_int8.int8_gemv(triton_activations.quantize_activations(x), w, type_name, block_n=block_n,
                                    split_k=split_k, blocks_per_step=kb, variant=variant)
        assert float((got - ref).abs().max()) <= 1e-5 * scale, variant


# (m, n, blocks_k, split_k, block_n, kb, dtype): N odd and not a multiple of the row
# tile, K ranges of unequal length (split-K) and whole rows (no split), dead blocks in a
# step, 1 to gemv_max_rows() activation rows, bfloat16 and float32 rows.
QUANT_X_CASES = [(1, 7, 3, 1, 4, 2, torch.float32), (3, 5, 5, 2, 4, 2, torch.bfloat16),
                 (16, 3, 2, None, 4, 4, torch.bfloat16), (2, 9, 2, 3, 8, 4, torch.float32),
                 (1, 5, 4, 1, 1, 16, torch.bfloat16)]


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q6_K_P"])
@pytest.mark.parametrize("m,n,blocks_k,split_k,block_n,kb,dtype", QUANT_X_CASES)
def test_int8_gemv_quantizing_its_rows_equals_quantizing_apart(dev, type_name, m, n, blocks_k, split_k, block_n, kb,
                                                              dtype):
    """The GEMV given float rows (quantized as it reads them, one launch) equals it given
    the rows' codes from :func:`quantize_activations` (two launches) bit for bit, at
    every tiling variant; a group of zeros (scale 0) included."""
    from kernels.quant import triton_activations, triton_int8

    if type_name == "Q6_K_P":  # its rows are read as 32-bit words: an even number of blocks
        blocks_k += blocks_k % 2
    x, w = _case(type_name, m, n, blocks_k, dev, dtype=dtype, seed=10 + m)
    x[0, 32:64] = 0
    variants = [{}, {"PREFETCH": 1}] + ([{"SPLIT": 1}, {"SPLIT": 1, "PREFETCH": 1}] if type_name == "Q4_K" else [])
    for variant in variants:
        tiling = dict(block_n=block_n, split_k=split_k, blocks_per_step=kb, variant=variant)
        apart = triton_int8.int8_gemv(triton_activations.quantize_activations(x), w, type_name, **tiling)
        fused = triton_int8.int8_gemv(x, w, type_name, **tiling)
        assert fused.dtype == dtype and torch.equal(fused, apart), variant


def test_int8_gemv_quantizing_its_rows_into_a_column_slice(dev):
    """Float rows in, the product written into columns of a wider output (a part of a
    fused projection), float16 rows too; rows that are not float or not unit-stride
    are refused."""
    from kernels.quant import triton_activations, triton_int8

    x, w = _case("Q4_K", 2, 5, 2, dev, dtype=torch.float16, seed=11)
    wide = torch.full((2, 8), 7.0, device=dev, dtype=torch.float16)
    got = triton_int8.int8_gemv(x, w, "Q4_K", block_n=4, out=wide[:, 1:6])
    assert got.data_ptr() == wide[:, 1:6].data_ptr()
    assert torch.equal(wide[:, 1:6], triton_int8.int8_gemv(triton_activations.quantize_activations(x), w, "Q4_K", block_n=4))
    assert bool((wide[:, 0] == 7).all() and (wide[:, 6:] == 7).all())
    with pytest.raises(ValueError, match="want float activations"):
        triton_int8.int8_gemv(x.t().contiguous().t(), w, "Q4_K")
    with pytest.raises(ValueError, match="want float activations"):
        triton_int8.int8_gemv(x.to(torch.int32), w, "Q4_K")


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K_P"), ("Q6_K", "Q4_K")])
@pytest.mark.parametrize("m,n0,n1,blocks_k,split_k,block_n,kb,dtype",
                         [(1, 7, 3, 2, 1, 4, 2, torch.float32), (3, 5, 9, 4, 2, 4, 2, torch.bfloat16),
                          (16, 8, 5, 2, None, 8, 4, torch.bfloat16), (2, 3, 2, 2, 3, 4, 4, torch.float32)])
def test_int8_gemv_of_two_parts_in_one_launch_equals_a_launch_each(dev, types, m, n0, n1, blocks_k, split_k, block_n,
                                                                   kb, dtype):
    """Two parts of different types in one launch (each program's rows of one part; the
    first part's last tile partial, so the second's start a tile): each part's columns
    equal its own launch bit for bit, from float rows and from their codes, at every
    tiling variant (``SPLIT`` acting on the Q4_K part only)."""
    from kernels.quant import triton_activations, triton_int8

    rng = np.random.default_rng(13 + m)
    k = blocks_k * 256
    parts = [(torch.from_numpy(random_blocks(t, n, k, rng)).to(dev), t) for t, n in zip(types, (n0, n1), strict=True)]
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to(dtype).to(dev)
    for rows in (x, triton_activations.quantize_activations(x)):
        for variant in ({}, {"PREFETCH": 1}, {"SPLIT": 1}):
            tiling = dict(block_n=block_n, split_k=split_k, blocks_per_step=kb, variant=variant)
            one = triton_int8.int8_gemv_parts(rows, parts, **tiling)
            each = torch.cat([triton_int8.int8_gemv(rows, w, t, **tiling) for w, t in parts], dim=1)
            assert one.shape == (m, n0 + n1) and torch.equal(one, each), variant


def test_int8_gemv_of_parts_refuses_none_three_or_other_widths(dev):
    from kernels.quant import triton_int8

    x, w = _case("Q4_K", 1, 3, 2, dev)
    _, narrow = _case("Q6_K", 1, 3, 1, dev)
    with pytest.raises(ValueError, match="one or two parts"):
        triton_int8.int8_gemv_parts(x, [])
    with pytest.raises(ValueError, match="one or two parts"):
        triton_int8.int8_gemv_parts(x, [(w, "Q4_K")] * 3)
    with pytest.raises(ValueError, match="do not hold rows of K=512"):
        triton_int8.int8_gemv_parts(x, [(w, "Q4_K"), (narrow, "Q6_K")])


@pytest.mark.parametrize("m", [1, 3])
def test_quant_linear_output_is_the_same_whichever_launches_it_takes(dev, monkeypatch, m):
    """A fused q/k/v-like projection of Q4_K and Q6_K_P parts with a bias, in decode
    rows: its output with the activations quantized inside the GEMV and both parts in
    one launch (the default) equals its output with a launch a part, and with the
    activations quantized by a launch of their own, bit for bit; all equal the int8
    reference of its parts."""
    from engine.layers.linear import gguf_blocks as quant_linear
    from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear
    from kernels.quant import triton_int8

    if dev == "cpu":  # the Triton path, interpreted, on CPU tensors
        monkeypatch.setattr(quant_linear, "use_triton", lambda t: True)
    k, rows = 512, (5, 3)
    layer = QuantLinear(k, [PartSpec(rows[0], "Q4_K"), PartSpec(rows[1], "Q6_K")], bias=True, dtype=torch.bfloat16)
    layer = layer.to_empty(device=dev)
    rng = np.random.default_rng(12)
    for (spec, buf), seed in zip(layer.part_views(), (0, 1), strict=True):
        buf.copy_(torch.from_numpy(random_blocks(spec.type_name, spec.rows, k, np.random.default_rng(seed))))
    layer.repack_for_kernels()  # as the loader does on CUDA
    assert [p.type_name for p in layer.parts] == ["Q4_K", "Q6_K_P"]
    layer.bias.copy_(torch.linspace(-1, 1, sum(rows)))
    x = torch.from_numpy(rng.standard_normal((m, 1, k), dtype=np.float32)).to(torch.bfloat16).to(dev)
    launches = []
    gemv_parts = triton_int8.int8_gemv_parts

    def counted(rows_in, parts, **kwargs):
        launches.append(len(parts))
        return gemv_parts(rows_in, parts, **kwargs)

    monkeypatch.setattr(triton_int8, "int8_gemv_parts", counted)
    outputs = {}
    for fuse, one_launch in ((True, True), (True, False), (False, True), (False, False)):
        with using(quant_int8_fuse=fuse, quant_int8_parts=one_launch):
            launches.clear()
            outputs[fuse, one_launch] = layer(x)
            assert launches == ([2] if one_launch else [1, 1])
    default = outputs[True, True]
    assert default.shape == (m, 1, sum(rows))
    assert all(torch.equal(default, y) for y in outputs.values())
    x2 = x.reshape(m, k).float()
    want = torch.cat([reference.quant_matmul_int8(x2, w, spec.type_name) for spec, w in layer.part_views()], dim=1)
    want = want + layer.bias.float()
    assert float((default.reshape(m, -1).float() - want).abs().max()) <= 2**-6 * float(want.abs().max())


def test_quant_linear_takes_its_rows_quantized_by_their_producer(dev, monkeypatch):
    """:meth:`QuantLinear.wants_int8` asks for decode rows quantized by the kernel that
    writes them exactly where ``forward`` would quantize them in a launch of its own
    (int8 parts, up to gemv_max_rows() rows, quantized apart) and the switch is on; given
    them as ``q8``, ``forward`` launches no quantizing kernel and its output is the same
    bit for bit."""
    from engine.layers.linear import gguf_blocks as quant_linear
    from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear
    from kernels.quant import triton_activations
    from kernels.quant import triton_kernel as triton_quant

    if dev == "cpu":  # the Triton path, interpreted, on CPU tensors
        monkeypatch.setattr(quant_linear, "use_triton", lambda t: True)
    k = 256
    layer = QuantLinear(k, [PartSpec(4, "Q4_K"), PartSpec(3, "Q6_K")], bias=False, dtype=torch.bfloat16)
    layer = layer.to_empty(device=dev)
    for (spec, buf), seed in zip(layer.part_views(), (0, 1), strict=True):
        buf.copy_(torch.from_numpy(random_blocks(spec.type_name, spec.rows, k, np.random.default_rng(seed))))
    dense = QuantLinear(k, [PartSpec(4, None)], bias=False, dtype=torch.bfloat16)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(dev)
    with using(quant_int8_fuse=False, quant_int8_producer=True):
        assert layer.wants_int8(x) and layer.wants_int8(x[:1, None, :])
        assert not layer.wants_int8(x.new_empty(triton_quant.gemv_max_rows() + 1, k))  # prefill: the GEMM
        assert not dense.wants_int8(x)
        launches = []
        quantize = triton_activations.quantize_activations
        monkeypatch.setattr(triton_activations, "quantize_activations",
                            lambda rows: launches.append(1) or quantize(rows))
        own = layer(x)
        assert launches == [1]
        given = layer(x, q8=quantize(x))
        assert launches == [1] and torch.equal(given, own)
    with using(quant_int8_fuse=False, quant_int8_producer=False):
        assert not layer.wants_int8(x)
    with using(quant_int8_fuse=True, quant_int8_producer=True):  # the GEMV quantizes its float rows: none to hand over
        assert not layer.wants_int8(x)


def test_int8_activations_equal_the_reference_codes(dev):
    """Codes, scales and sums bit for bit (correctly rounded divisions in the kernel),
    a group of zeros and a partial program of groups included; bfloat16 rows too."""
    from kernels.quant import triton_activations

    rng = np.random.default_rng(6)
    x = torch.from_numpy(rng.standard_normal((3, 40 * 32), dtype=np.float32) * 3).to(dev)
    x[1, 64:96] = 0
    for xs in (x, x.to(torch.bfloat16)):
        q8 = triton_activations.quantize_activations(xs)
        codes, scales, sums = reference.quantize_activations(xs)
        assert torch.equal(q8.codes, codes) and torch.equal(q8.scales, scales) and torch.equal(q8.sums, sums)
        assert q8.dtype == xs.dtype and int(q8.codes.abs().max()) == 127 and float(q8.scales[1, 2]) == 0


def test_int8_gemv_bfloat16_into_a_column_slice(dev):
    """bfloat16 rows, one quantization shared by two parts writing columns of one output
    (a fused projection of Q4_K and Q6_K shards)."""
    from kernels.quant import triton_activations
    from kernels.quant import triton_kernel as triton_quant

    x, w4 = _case("Q4_K", 2, 5, 2, dev, dtype=torch.bfloat16, seed=7)
    _, w6 = _case("Q6_K", 2, 3, 2, dev, seed=8)
    q8 = triton_activations.quantize_activations(x)
    wide = torch.full((2, 10), 7.0, device=dev, dtype=torch.bfloat16)
    triton_quant.quant_gemv(x, w4, "Q4_K", block_n=4, out=wide[:, 1:6], int8_dot=True, q8=q8)
    triton_quant.quant_gemv(x, w6, "Q6_K", block_n=4, out=wide[:, 6:9], int8_dot=True, q8=q8)
    for got, w, t in ((wide[:, 1:6], w4, "Q4_K"), (wide[:, 6:9], w6, "Q6_K")):
        ref = reference.quant_matmul_int8(x.float(), w, t)
        assert float((got.float() - ref).abs().max()) <= 2**-6 * float(ref.abs().max())
    assert bool((wide[:, 0] == 7).all() and (wide[:, 9] == 7).all())


def test_int8_gemv_refuses_other_types(dev):
    from kernels.quant import triton_activations, triton_int8

    x, w = _case("Q4_1", 1, 3, 8, dev)
    with pytest.raises(ValueError, match="int8 GEMV reads Q4_K, Q6_K"):
        triton_int8.int8_gemv(triton_activations.quantize_activations(x), w, "Q4_1")


def test_int8_gemv_refuses_q6k_planes_of_odd_blocks(dev):
    from kernels.quant import triton_activations, triton_int8

    x, w = _case("Q6_K_P", 1, 3, 3, dev)
    with pytest.raises(ValueError, match="do not hold rows"):
        triton_int8.int8_gemv(triton_activations.quantize_activations(x), w, "Q6_K_P")


def _assert_q8_of(q8, out: torch.Tensor) -> None:
    """``q8`` equals :func:`quantize_activations` of ``out``'s rows bit for bit."""
    from kernels.quant import triton_activations

    want = triton_activations.quantize_activations(out.reshape(-1, out.shape[-1]))
    assert q8.dtype == out.dtype
    for name in ("codes", "scales", "sums"):
        got, ref = getattr(q8, name), getattr(want, name)
        assert got.dtype == ref.dtype and torch.equal(got, ref), name


PRODUCER_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", PRODUCER_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [96, 576])
def test_norms_quantizing_their_output_equal_a_quantizing_launch(dev, dtype, m, k):
    """RMSNorm and residual-add + RMSNorm with ``quantize=True``: the same output (and
    residual) as without, bit for bit, and the codes, scales and sums of
    :func:`quantize_activations` of that output; rows of a width that is not a power of
    two (padding groups in the kernel's row), a group of zeros included."""
    from kernels.norm import triton_kernel as triton_norm

    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).to(dev)
    x[0, 32:64] = 0
    res = torch.randn(m, k, generator=g).to(dtype).to(dev)
    w = torch.randn(k, generator=g).to(dtype).to(dev)
    plain = triton_norm.rms_norm(x, w, 1e-6)
    out, q8 = triton_norm.rms_norm(x, w, 1e-6, quantize=True)
    assert torch.equal(out, plain)
    _assert_q8_of(q8, out)
    assert float(q8.scales[0, 1]) == 0
    res_plain = res.clone()
    plain, _ = triton_norm.fused_add_rms_norm(x, res_plain, w, 1e-6)
    out, r, q8 = triton_norm.fused_add_rms_norm(x, res, w, 1e-6, quantize=True)
    assert r is res and torch.equal(res, res_plain) and torch.equal(out, plain)
    _assert_q8_of(q8, out)


@pytest.mark.parametrize("dtype", PRODUCER_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("inter", [96, 576, 1120])
def test_silu_and_mul_quantizing_its_output_equals_a_quantizing_launch(dev, dtype, m, inter):
    """SiLU-and-mul with ``quantize=True``: the same output bit for bit, and its codes as
    :func:`quantize_activations` gives them; 1120 columns take two programs a row (the
    second's groups start at 32), leading dimensions are kept."""
    from kernels.activation import triton_kernel as triton_activation

    g = torch.Generator().manual_seed(m + inter)
    x = (torch.randn(m, 1, 2 * inter, generator=g) * 3).to(dtype).to(dev)
    x[-1, 0, :32] = 0
    plain = triton_activation.silu_and_mul(x)
    out, q8 = triton_activation.silu_and_mul(x, quantize=True)
    assert out.shape == (m, 1, inter) and torch.equal(out, plain)
    _assert_q8_of(q8, out)


def test_producers_refuse_to_quantize_rows_of_partial_groups(dev):
    from kernels.activation import triton_kernel as triton_activation
    from kernels.norm import triton_kernel as triton_norm

    x = torch.randn(2, 48, device=dev)
    with pytest.raises(ValueError, match="whole groups of 32"):
        triton_norm.rms_norm(x, torch.ones(48, device=dev), 1e-6, quantize=True)
    with pytest.raises(ValueError, match="whole groups of 32"):
        triton_activation.silu_and_mul(torch.randn(2, 96, device=dev), quantize=True)  # 48 outputs a row
