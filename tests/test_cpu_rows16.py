"""Blocks interleaved by 16 weight rows (kernels/cpu/rows16.c, kernels/cpu/rows16.py;
Q4_0/Q4_1/Q8_0 and Q4_K):
the layout's bytes undo to the GGUF blocks exactly, the product on it equals gguf's
dequantizer times the 16-bit activation codes (kernels/cpu/block_gemv.py's reference) to
float32 order on odd shapes, what it cannot take is refused, a build without AVX-512 keeps
the GGUF layout, and a CPU model's layers take it under the ``cpu_rows16`` switch."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from test_cpu_kernels import _tolerance  # noqa: E402

from engine.layers.linear.cpu_blocks import GEMM_ROWS, CpuBlockLinear  # noqa: E402
from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear  # noqa: E402
from kernels.cpu import build, rows16  # noqa: E402
from kernels.cpu.block_gemv import block_gemv, block_gemv_ref  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402

# (weight rows, K, activation rows): one group of 16 and several, K of one block and of
# the default model's down projection, one activation row (decode), a pass of 8 and the
# passes past it, a prefill's many rows.
SHAPES = [(16, 32, 1), (48, 96, 3), (32, 1536, 1), (160, 576, 8), (64, 64, 9), (16, 96, 17), (96, 576, 70)]
# The K-quants' super-blocks take K in 256s: the same, K of one super-block up to the widened
# default model's down projection (tests/kquant_files.py).
KSHAPES = [(16, 256, 1), (48, 512, 3), (32, 1536, 1), (160, 768, 8), (64, 256, 9), (16, 512, 17), (96, 768, 70),
           (32, 2304, 20)]
CASES = [(t, *shape) for t in rows16.TYPES for shape in (KSHAPES if t in rows16.KQUANTS else SHAPES)]


def _cols(type_name: str) -> int:
    """A K of several blocks that the type takes."""
    return 512 if type_name in rows16.KQUANTS else 96


def _case(type_name: str, rows: int, cols: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF blocks ``[rows, bytes]`` and activations ``[m, cols]`` with an outlier."""
    blocks = torch.from_numpy(random_blocks(type_name, rows, cols, np.random.default_rng(rows * cols + m)))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(rows + m))
    x[0, 3] = 40.0  # a block with an outlier, as real activations have
    return blocks, x


def _needs(lib: ctypes.CDLL) -> None:
    if not rows16.available(lib):
        pytest.skip("this build has no AVX-512: it keeps the GGUF layout")


@pytest.mark.parametrize("type_name", rows16.TYPES)
def test_interleaving_moves_the_bytes_and_undoes_exactly(type_name):
    blocks, _ = _case(type_name, 48, _cols(type_name), 1)
    inter = rows16.interleave(blocks, type_name)
    assert inter.shape == blocks.shape and inter.dtype == torch.uint8
    assert not torch.equal(inter, blocks)
    assert torch.equal(rows16.deinterleave(inter, type_name), blocks)
    # The first chunk starts with the 16 rows' float16 scales d, one after another.
    at = 208 if type_name == "Q6_K" else 0  # where a block keeps its d
    d = blocks.view(48, -1)[:16, at:at + 2].reshape(-1)
    assert torch.equal(inter.view(-1)[:32], d)


@pytest.mark.parametrize("type_name", rows16.TYPES)
@pytest.mark.parametrize(("rows", "blocks_a_row"), [(16, 1), (48, 3), (80, 2)])
def test_the_c_interleave_writes_the_torch_layout_byte_for_byte(lib, type_name, rows, blocks_a_row):
    """interleave.c (a CPU engine's load) against the torch reshapes, 1-5 groups of 16
    rows of 1-3 blocks, into a new tensor and into a given one; a row that is not whole
    blocks is refused."""
    cols = blocks_a_row * (256 if type_name in rows16.KQUANTS else 32)
    blocks, _ = _case(type_name, rows, cols, 1)
    want = rows16.interleave(blocks, type_name)
    assert torch.equal(rows16.interleave(blocks, type_name, lib), want)
    out = torch.zeros_like(blocks)
    assert rows16.interleave(blocks, type_name, lib, out=out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="not whole"):
        rows16.interleave(blocks[:, 1:], type_name, lib)
    with pytest.raises(ValueError, match="out"):
        rows16.interleave(blocks, type_name, lib, out=torch.zeros(rows, 3, dtype=torch.uint8))


@pytest.mark.parametrize(("type_name", "rows", "cols", "m"), CASES)
def test_the_interleaved_product_equals_gguf_s_dequantizer_times_the_codes(lib, type_name, rows, cols, m):
    _needs(lib)
    blocks, x = _case(type_name, rows, cols, m)
    got = block_gemv(lib, x, rows16.interleave(blocks, type_name), type_name + rows16.SUFFIX)
    assert got.shape == (m, rows) and got.dtype == torch.float32
    want = block_gemv_ref(x, blocks, type_name)
    assert float((got - want).abs().max()) <= _tolerance(x, blocks, type_name)
    # One thread and two split the groups differently: the same outputs.
    one = block_gemv(lib, x, rows16.interleave(blocks, type_name), type_name + rows16.SUFFIX, threads=1)
    assert torch.equal(one, got)


@pytest.mark.parametrize("type_name", rows16.KQUANTS)
@pytest.mark.parametrize("cols", [256, 1280, 2304])
def test_many_rows_give_the_bits_of_one_pass_at_a_time(lib, type_name, cols):
    """Past 8 activation rows Q5_K and Q6_K widen a group's weights once for all passes
    (rows16_many.c), in chunks of 4 super-blocks (K of 1, 5 and 9 of them): the same
    float32 operations in the same order as passes of up to 8 rows, so the same bits."""
    _needs(lib)
    blocks, x = _case(type_name, 48, cols, 21)
    inter = rows16.interleave(blocks, type_name)
    name = type_name + rows16.SUFFIX
    whole = block_gemv(lib, x, inter, name)
    passes = torch.cat([block_gemv(lib, x[m:m + 8], inter, name) for m in range(0, 21, 8)])
    assert torch.equal(whole, passes)
    assert float((whole - block_gemv_ref(x, blocks, type_name)).abs().max()) <= _tolerance(x, blocks, type_name)


def test_what_the_layout_cannot_take_is_refused(lib):
    blocks, x = _case("Q4_1", 24, 64, 2)
    with pytest.raises(ValueError, match="multiples of 16"):
        rows16.interleave(blocks, "Q4_1")
    with pytest.raises(ValueError, match="multiples of 16"):
        rows16.interleave(torch.from_numpy(random_blocks("Q5_0", 16, 256, np.random.default_rng(0))), "Q5_0")
    _needs(lib)
    # Blocks called interleaved whose rows are no multiple of 16: the kernel refuses them.
    with pytest.raises(ValueError, match="multiple of 16"):
        block_gemv(lib, x, blocks, "Q4_1x16")


def _quant_linear(specs: list[PartSpec], cols: int) -> QuantLinear:
    q = QuantLinear(cols, specs, bias=False, dtype=torch.float32)
    rng = np.random.default_rng(7)
    for spec, buf in q.part_views():
        buf.copy_(torch.from_numpy(random_blocks(spec.type_name, spec.rows, cols, rng)))
    return q


def test_a_projection_interleaves_its_runs_of_16_rows_and_keeps_the_file_s_blocks(lib):
    """Runs whose rows are a multiple of 16 interleave (a copy: the QuantLinear's blocks, a
    kept file form, stay as they are), others keep the GGUF layout; decode rows and a
    prefill's many rows (past the float32 GEMM's threshold) give the GGUF layout's
    products to float32 order."""
    _needs(lib)
    cols = 96
    q = _quant_linear([PartSpec(32, "Q4_1"), PartSpec(40, "Q8_0"), PartSpec(48, "Q4_0")], cols)
    before = [w.clone() for _, w in q.part_views()]
    plain = CpuBlockLinear.from_quant_linear(lib, q, torch.float32)
    inter = CpuBlockLinear.from_quant_linear(lib, q, torch.float32, interleave=True)
    assert plain.types == ["Q4_1", "Q8_0", "Q4_0"]
    assert inter.types == ["Q4_1x16", "Q8_0", "Q4_0x16"]
    assert inter.source_types == plain.source_types == {"Q4_1": 32 * cols, "Q8_0": 40 * cols, "Q4_0": 48 * cols}
    assert all(torch.equal(w, b) for (_, w), b in zip(q.part_views(), before, strict=True))
    assert sum(inter.part(i).numel() for i in range(3)) == sum(b.numel() for b in before)
    for m in (1, 5, GEMM_ROWS + 3):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        want = torch.cat([block_gemv_ref(x, b, s.type_name) for (s, _), b in zip(q.part_views(), before, strict=True)],
                         dim=1)
        tol = max(_tolerance(x, b, s.type_name) for (s, _), b in zip(q.part_views(), before, strict=True))
        assert float((inter(x) - want).abs().max()) <= tol, m


def test_k_quants_interleave_only_with_16_bit_activation_codes(lib):
    """The K-quants' interleaved products take 16-bit codes: under ``cpu_kquant_act_bits``
    8 a projection keeps the GGUF layout (the switch's 8-bit products), under 16 it
    interleaves; and interleaved Q4_K blocks called with the 8-bit path still give the
    16-bit products."""
    from kernels.switches import using

    _needs(lib)
    q = _quant_linear([PartSpec(32, "Q4_K"), PartSpec(16, "Q6_K")], 512)
    with using(cpu_kquant_act_bits="8"):
        assert CpuBlockLinear.from_quant_linear(lib, q, torch.float32, interleave=True).types == ["Q4_K", "Q6_K"]
        blocks, x = _case("Q4_K", 32, 512, 3)
        got = block_gemv(lib, x, rows16.interleave(blocks, "Q4_K"), "Q4_Kx16")
    # The reference with 16-bit codes (under 8 it quantizes as the 8-bit products do).
    assert float((got - block_gemv_ref(x, blocks, "Q4_K")).abs().max()) <= _tolerance(x, blocks, "Q4_K")
    assert CpuBlockLinear.from_quant_linear(lib, q, torch.float32, interleave=True).types == ["Q4_Kx16", "Q6_Kx16"]


def _build_without(flag: str, folder) -> ctypes.CDLL:
    """The library's sources built with ``flag`` (a -mno-... of -march=native)."""
    folder.mkdir()
    return build.build_variant(folder, (flag,))


def test_an_avx512_build_without_vnni_gives_the_reference_s_products(lib, tmp_path):
    """Built with -mno-avx512vnni (AVX-512 BW without vpdpwssd: vpmaddwd and an add)."""
    _needs(lib)
    novnni = _build_without("-mno-avx512vnni", tmp_path / "novnni")
    assert rows16.available(novnni)
    for type_name in rows16.TYPES:
        blocks, x = _case(type_name, 48, _cols(type_name), 9)
        got = block_gemv(novnni, x, rows16.interleave(blocks, type_name), type_name + rows16.SUFFIX)
        assert float((got - block_gemv_ref(x, blocks, type_name)).abs().max()) <= _tolerance(x, blocks, type_name)


def test_a_build_without_avx512_keeps_the_gguf_layout(lib, tmp_path):
    """Built with -mno-avx512f: the interleaved product is not there, a projection asked
    to interleave keeps its GGUF blocks, and the kernel refuses interleaved ids."""
    if lib.hr_simd_level() < 2:
        pytest.skip("the engine's own build has no AVX-512 (the rest of this file skips)")
    avx2 = _build_without("-mno-avx512f", tmp_path / "avx2")
    assert avx2.hr_simd_level() == 1 and not rows16.available(avx2)
    q = _quant_linear([PartSpec(32, "Q4_1")], 64)
    assert CpuBlockLinear.from_quant_linear(avx2, q, torch.float32, interleave=True).types == ["Q4_1"]
    blocks, x = _case("Q4_1", 16, 64, 1)
    with pytest.raises(ValueError, match="AVX-512"):
        block_gemv(avx2, x, rows16.interleave(blocks, "Q4_1"), "Q4_1x16")


def test_a_huge_buffer_holds_its_tensors_one_after_another():
    """The tensors have the shapes asked for, sit one after another from a 2 MiB
    boundary, and take what is copied in."""
    shapes = [(16, 40), (32, 20), (48, 60)]
    views = rows16.huge_buffer(shapes)
    assert [tuple(v.shape) for v in views] == shapes and all(v.dtype == torch.uint8 for v in views)
    assert views[0].data_ptr() % (2 << 20) == 0
    for a, b in zip(views[:-1], views[1:], strict=True):
        assert b.data_ptr() == a.data_ptr() + a.numel()
    parts = [torch.randint(0, 256, shape, dtype=torch.uint8) for shape in shapes]
    for v, p in zip(views, parts, strict=True):
        v.copy_(p)
    assert all(torch.equal(v, p) for v, p in zip(views, parts, strict=True))
    assert rows16.huge_buffer([]) == []


@pytest.mark.parametrize("type_name", rows16.KQUANTS)
def test_an_interleaved_k_quant_table_looks_up_the_file_s_rows(lib, type_name):
    """A tied head's table of Q4_K/Q6_K blocks, interleaved: a lookup gives gguf's values
    of the rows asked for (any order, repeats), as the GGUF layout's lookup does; an id
    outside the table is refused. The lookup is plain C: a build without AVX-512 has it."""
    from kernels.cpu.block_gemv import dequantize_ids
    from kernels.quant import reference

    blocks = torch.from_numpy(random_blocks(type_name, 64, 512, np.random.default_rng(3)))
    ids = torch.tensor([0, 17, 63, 5, 17, 40])
    got = dequantize_ids(lib, rows16.interleave(blocks, type_name), type_name + rows16.SUFFIX, ids)
    assert torch.equal(got, reference.dequantize(blocks, type_name, 512)[ids])
    assert torch.equal(got, dequantize_ids(lib, blocks, type_name, ids))
    with pytest.raises(ValueError, match="ids"):
        dequantize_ids(lib, rows16.interleave(blocks, type_name), type_name + rows16.SUFFIX, torch.tensor([64]))
