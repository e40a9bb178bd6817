"""The C CPU kernels (kernels/cpu): the block GEMV against its torch reference, in its
vector build and its plain C one; the C decode layer against the torch layers it stands
for, on tiny Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm) GGUFs of Q8_0,
Q4_0 and Q4_1 blocks and of Q4_K_M's mix of Q4_K and Q6_K; the build's fallbacks (no compiler, a failing one, the switch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from test_gguf_convert import VOCAB, write_gguf  # noqa: E402

from engine.kvcache.pool import kv_storage_dtype  # noqa: E402
from engine.layers.cpu_pack import pack_model_for_cpu  # noqa: E402
from engine.layers.linear.cpu_blocks import CpuBlockLinear  # noqa: E402
from engine.layers.linear.cpu_kernels import cpu_kernels  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.load import load_model  # noqa: E402
from kernels.attention.kv_store import gather_kv, to_kv_dtype  # noqa: E402
from kernels.cpu import build, decode_layer, rows16  # noqa: E402
from kernels.cpu.block_gemv import TYPE_IDS, block_gemv, block_gemv_ref, quantize_rows_ref  # noqa: E402
from kernels.quant import reference  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402


def _tolerance(x: torch.Tensor, blocks: torch.Tensor, type_name: str) -> float:
    """float32 summation order over ``K`` products: a few ulps of ``|x| @ |w|.T``."""
    w = reference.dequantize(blocks, type_name, x.shape[1])
    return float((x.abs() @ w.abs().T).max()) * 2e-6


@pytest.mark.parametrize("type_name", list(TYPE_IDS))
@pytest.mark.parametrize(("rows", "cols", "m"), [(96, 64, 1), (130, 576, 3), (64, 1536, 16), (7, 32, 5), (1, 96, 2)])
@pytest.mark.parametrize("scalar", [False, True])
def test_block_gemv_equals_its_reference(lib, type_name, rows, cols, m, scalar):
    """Rows not a multiple of the kernel's tile of 4, one block a row, 1-16 activation
    rows; the vector build and the plain C one."""
    blocks = torch.from_numpy(random_blocks(type_name, rows, cols, np.random.default_rng(rows * cols + m)))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(rows))
    x[0, 3] = 40.0  # a block with an outlier, as real activations have
    got = block_gemv(lib, x, blocks, type_name, scalar=scalar)
    want = block_gemv_ref(x, blocks, type_name)
    assert got.shape == (m, rows) and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= _tolerance(x, blocks, type_name)


def test_activation_codes_keep_an_outlier_block_s_small_values():
    """16-bit codes: a block whose largest value is 1,000 times the rest still carries
    the rest to about 2**-15 of the largest (8-bit codes would round them all to 0)."""
    x = torch.full((1, 32), 0.01)
    x[0, 0] = 10.0
    codes, d = quantize_rows_ref(x)
    back = codes.float() * d[..., None]
    assert float((back - x).abs().max()) <= 10.0 / 32767
    assert codes.dtype == torch.int16 and int(codes[0, 0]) == 32767


@pytest.mark.parametrize("scalar", [False, True])
def test_a_nan_or_an_infinity_in_the_activations_makes_its_row_nan(lib, scalar):
    """As float arithmetic would: a row holding a NaN or an infinity gives NaN outputs,
    the other rows stay finite; tiny blocks (below a scale's reciprocal) give zeros, not
    undefined codes; K = 0 is an empty sum."""
    blocks = torch.from_numpy(random_blocks("Q8_0", 8, 64, np.random.default_rng(1)))
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3] = 1e-36
    y = block_gemv(lib, x, blocks, "Q8_0", scalar=scalar)
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isnan(y[2]).all())
    assert bool(torch.isfinite(y[0]).all()) and float(y[3].abs().max()) <= 1e-30
    assert torch.equal(block_gemv(lib, torch.empty(2, 0), torch.empty(8, 0, dtype=torch.uint8), "Q8_0"),
                       torch.zeros(2, 8))


def test_block_gemv_writes_into_a_wider_output_and_refuses_what_it_cannot_take(lib):
    blocks = torch.from_numpy(random_blocks("Q4_1", 8, 64, np.random.default_rng(0)))
    x = torch.randn(2, 64)
    y = torch.zeros(2, 20)
    block_gemv(lib, x, blocks, "Q4_1", out=y[:, 4:12])
    assert float((y[:, 4:12] - block_gemv_ref(x, blocks, "Q4_1")).abs().max()) <= _tolerance(x, blocks, "Q4_1")
    assert torch.equal(y[:, :4], torch.zeros(2, 4)) and torch.equal(y[:, 12:], torch.zeros(2, 8))
    with pytest.raises(ValueError, match="Q5_0 has no CPU block kernel"):
        block_gemv(lib, x, blocks, "Q5_0")
    with pytest.raises(ValueError, match="do not match"):
        block_gemv(lib, torch.randn(2, 96), blocks, "Q4_1")  # rows of K=96 take more bytes
    assert block_gemv(lib, torch.empty(0, 64), blocks, "Q4_1").shape == (0, 8)


@pytest.mark.parametrize("type_name", list(TYPE_IDS))
def test_dequantized_rows_are_gguf_s_and_many_rows_take_the_float32_gemm(lib, type_name):
    """The prefill path without the AVX-512 block GEMM (its switch off, or a CPU without
    it): rows dequantized by the C kernel equal gguf's dequantizer bit for bit; a
    CpuBlockLinear of many activation rows (chunks of weight rows, a mixed part beside
    it) gives float32 products of them, few rows the block GEMV."""
    from engine.layers.linear import cpu_blocks as cpu_block_linear
    from kernels.cpu.block_gemv import dequantize_rows
    from kernels.switches import using

    rng = np.random.default_rng(7)
    blocks = torch.from_numpy(random_blocks(type_name, 300, 96, rng))
    want = reference.dequantize(blocks, type_name, 96)
    assert torch.equal(dequantize_rows(lib, blocks, type_name, 0, 300), want)
    assert torch.equal(dequantize_rows(lib, blocks, type_name, 17, 18), want[17:18])
    with pytest.raises(ValueError, match="rows 5-301"):
        dequantize_rows(lib, blocks, type_name, 5, 301)
    linear = CpuBlockLinear(lib, 96, [(type_name, blocks)], None)
    many = torch.randn(cpu_block_linear.GEMM_ROWS + 3, 96)
    with using(cpu_block_gemm=False):
        torch.testing.assert_close(linear(many), many @ want.T, rtol=1e-5, atol=1e-4)
    few = torch.randn(2, 96)
    assert float((linear(few) - block_gemv_ref(few, blocks, type_name)).abs().max()) <= _tolerance(few, blocks, type_name)


def test_a_projection_of_mixed_types_keeps_the_others_in_torch_s_layout(lib):
    """q/k/v of Q4_1, Q8_0 and Q5_1 (which the C GEMV does not read) and dense rows, with
    a bias: the C-read runs in blocks, the rest a CpuInt4Linear of its own; the product
    is the dequantized reference's (to bfloat16 for the int4 part), and the plan's
    per-tensor price holds (blocks as stored, the rest as torch's layout holds it)."""
    from engine.layers.linear.cpu_int4 import CpuInt4Linear
    from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear
    from engine.layers.weight_census import model_weight_bytes

    rng = np.random.default_rng(3)
    cols = 128
    specs = [PartSpec(32, "Q4_1"), PartSpec(16, "Q8_0"), PartSpec(32, "Q5_1"), PartSpec(8, None)]
    q = QuantLinear(cols, specs, bias=True, dtype=torch.float32)
    for spec, buf in q.part_views():
        buf.copy_(torch.randn(spec.rows, cols) if spec.type_name is None
                  else torch.from_numpy(random_blocks(spec.type_name, spec.rows, cols, rng)))
    q.bias.copy_(torch.randn(q.out_features))
    linear = CpuBlockLinear.from_quant_linear(lib, q, torch.float32)
    assert linear.types == ["Q4_1", "Q8_0", None] and isinstance(linear.others[0], CpuInt4Linear)
    assert linear.source_types == {"Q4_1": 32 * cols, "Q8_0": 16 * cols, "Q5_1": 32 * cols}
    x = torch.randn(3, cols)
    w = torch.cat([reference.dequantize(b, s.type_name, cols) if s.type_name else b for s, b in q.part_views()])
    torch.testing.assert_close(linear(x), x @ w.T + q.bias, rtol=0, atol=float((x.abs() @ w.abs().T).max()) * 2**-8)
    blocks_bytes = sum(b.nbytes for s, b in q.part_views() if s.type_name in ("Q4_1", "Q8_0"))
    assert model_weight_bytes(linear) == blocks_bytes + model_weight_bytes(linear.others[0]) + q.bias.nbytes


# Q4_K_M's mix: v and down in Q6_K, the other projections Q4_K (q/k/v one projection of two types).
Q4_K_M = {"v_proj": "Q6_K", "down_proj": "Q6_K"}


@pytest.fixture(scope="module", params=[("llama", "Q8_0"), ("qwen2", "Q4_0"), ("qwen3", "Q4_1"), ("qwen3", "Q4_K_M")])
def tiny_blocks(request, tmp_path_factory, make_tiny_hf_model):
    """A tiny GGUF whose projections are of one block type (or Q4_K_M's mix, 256 wide so
    rows are whole K-quant blocks), loaded quantized on the CPU with the C kernels:
    ``(model, config)``."""
    arch, kind = request.param
    tmp = tmp_path_factory.mktemp(f"cpu-{arch}")
    path = tmp / f"tiny-{arch}.gguf"
    # Qwen3's heads of 32: 8 of them make the o projection's 256 inputs whole K-quant blocks.
    shape = (256, 512, 8) if kind == "Q4_K_M" else (64, 96, 4)
    hf = make_tiny_hf_model(arch, None, vocab_size=VOCAB, hidden_size=shape[0], intermediate_size=shape[1],
                            num_attention_heads=shape[2], num_key_value_heads=2)
    override = {}
    rng = np.random.default_rng(5)
    gguf_types = pytest.importorskip("gguf").GGMLQuantizationType
    for name, param in hf.named_parameters():
        if name.endswith("proj.weight"):
            from test_gguf_convert import _gguf_name

            rows, cols = param.shape
            type_name = Q4_K_M.get(name.split(".")[-2], "Q4_K") if kind == "Q4_K_M" else kind
            override[_gguf_name(name)] = (random_blocks(type_name, rows, cols, rng), gguf_types[type_name])
    write_gguf(path, arch, hf, override=override)
    folder = convert_gguf(path, tmp / "hf")
    model, config = load_model(folder, "cpu", torch.float32, quantized_gguf=path)
    return pack_model_for_cpu(model, torch.float32, cpu_kernels()), config


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "f16", "q8_0", "q4_0"])
def test_the_c_decode_layer_gives_the_torch_layers_logits(lib, tiny_blocks, paged_runner, kv_cache_dtype,
                                                         monkeypatch):
    """A prefill of 37 tokens and a second sequence of 3 (40 rows: the C halves' per-row
    work over the threads), decode steps of both sequences together, extends over a
    cached prefix, and a decode of one alone, through the C layers (a decode step in one
    call; the others in two halves around torch's attention) and through the torch
    layers over the same C GEMV: logits within 1e-3 of the largest
    (measured: 3e-5 to 1.3e-4; the norms, rotary and attention sum in another order, and
    a last-bit change of an activation can move its 16-bit code by one), and the KV pool
    the same. A query head reading the wrong KV head moves them by about 1. Over a pool
    of q8_0 or q4_0 blocks (Qwen3's heads of 32 are one block) the C layer writes the
    blocks the torch store writes, but where a key's last bit moves a code by one; over a
    float16 pool the values torch's cast writes, within one float16 step."""
    model, config = tiny_blocks
    if kv_cache_dtype not in ("auto", "f16") and config.head_dim % 32:
        pytest.skip(f"heads of {config.head_dim} are not whole {kv_cache_dtype} blocks")
    kv_dtype = kv_storage_dtype(kv_cache_dtype, torch.float32)
    assert model.cpu_decode is not None and len(model.cpu_decode.specs) == config.num_layers
    assert all(isinstance(m, CpuBlockLinear) for m in (model.model.layers[0].self_attn.qkv_proj,
                                                          model.model.layers[0].mlp.down_proj))
    qkv_types = model.model.layers[0].self_attn.qkv_proj.types
    # Every projection's rows are a multiple of 16: interleaved where the build has AVX-512.
    x16 = rows16.SUFFIX if rows16.available(lib) else ""
    if qkv_types[0].startswith("Q4_K"):  # q and k in Q4_K, v in Q6_K: a projection of two runs
        assert qkv_types == ["Q4_K" + x16, "Q6_K" + x16]
    else:
        assert qkv_types[0].endswith(rows16.SUFFIX) == rows16.available(lib)
    fast = model.cpu_decode
    calls = []  # per step through the C layers: 1 a decode step, 0 a prefill or extend
    monkeypatch.setattr(fast, "run", lambda h, batch, *a, **k: calls.append(int(batch.is_decode))
                        or type(fast).run(fast, h, batch, *a, **k))
    runs = {}
    for use in (True, False):
        model.cpu_decode = fast if use else None
        runner = paged_runner(model, config, page_size=4, num_pages=32, kv_dtype=kv_dtype)
        # 37 + 4 tokens: the float32 scores' blocks of 8 tokens and a tail.
        logits = [runner.step({0: [5, 70, 3, 20, 42] * 7 + [1, 2], 1: [9, 8, 7]})]
        assert not runner.last_batch.is_decode
        for tokens in ([11, 12], [13, 14], [15, 16], [17, 18]):
            logits.append(runner.step({0: [tokens[0]], 1: [tokens[1]]}))
            assert runner.last_batch.is_decode and fast.takes(runner.last_batch, logits[-1], runner.pool)
        # Extends over a cached prefix (the attention's masked path), one beside a decode row.
        for extend in ({0: [21, 22, 23]}, {0: [24, 25], 1: [26]}):
            logits.append(runner.step(extend))
            assert not runner.last_batch.is_decode and fast.takes(runner.last_batch, logits[-1], runner.pool)
        logits.append(runner.step({1: [19]}))
        runs[use] = (logits, [gather_kv(b, torch.arange(b.shape[0]), torch.float32)
                              for b in runner.pool.k_buffers + runner.pool.v_buffers])
    model.cpu_decode = fast
    assert calls == [0] + [1] * 4 + [0] * 2 + [1]  # every step on the C layers: prefills in halves, decodes whole
    for got, want in zip(runs[True][0], runs[False][0], strict=True):
        assert bool(torch.isfinite(got).all())
        assert float((got - want).abs().max()) <= 1e-3 * max(1.0, float(want.abs().max()))
    for got, want in zip(runs[True][1], runs[False][1], strict=True):
        # One code of the largest block (one float16 step at the largest value): a key's
        # last bit may move a code.
        code = float(want.abs().max()) / {"f16": 1024, "q8_0": 127, "q4_0": 7}.get(kv_cache_dtype, float("inf"))
        assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max())) + code


def test_a_long_prefill_s_scratch_is_freed_after_its_step(tiny_blocks, paged_runner, monkeypatch):
    """A prefill whose scratch passes the bytes kept between steps hands it back after the
    step (resident memory after a long prompt is what it was before), and the next steps
    allocate their own; a scratch under the bound stays for the next step."""
    from engine.layers import cpu_decode

    model, config = tiny_blocks
    fast = model.cpu_decode
    runner = paged_runner(model, config, page_size=4, num_pages=32)
    runner.step({0: [5, 70, 3, 20] * 6})
    kept = fast.scratch.numel()
    assert kept > 0
    monkeypatch.setattr(cpu_decode, "KEEP_SCRATCH_BYTES", kept - 1)
    runner.step({1: [9, 8, 7, 6] * 6})
    assert fast.scratch.numel() == 0
    monkeypatch.setattr(cpu_decode, "KEEP_SCRATCH_BYTES", 1 << 30)
    logits = runner.step({0: [11], 1: [12]})
    assert runner.last_batch.is_decode and bool(torch.isfinite(logits).all()) and fast.scratch.numel() > 0


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "q4_0"])
def test_the_c_kv_store_writes_the_torch_store_s_bytes(lib, fmt):
    """The C decode layer's store and the torch store's (llama.cpp's quantizer, byte for
    byte; torch's cast to float16) give the same bytes for the same values, an all-zero
    block and a block whose largest magnitude is negative among them; for float16 also
    values past its range (infinities), its subnormals, ties and a NaN, and a row length
    that leaves a tail after the vector loop."""
    x = torch.randn(500, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-6, 3, 64)
    x[0], x[1, :32], x[2, 3] = 0.0, 0.5, -1e4
    dtype = kv_storage_dtype(fmt, torch.float32)
    if fmt == "f16":
        x[3, :6] = torch.tensor([7e4, -7e4, 65519.0, 3e-6, -1e-7, float("nan")])
        x[4, :2] = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11])  # ties to even: down, then up
        x = torch.cat([x, torch.randn(500, 6)], dim=1)  # 70 values a row: a tail of 6
    assert torch.equal(decode_layer.quantize_kv(lib, x, dtype).view(torch.uint8),
                       to_kv_dtype(x, dtype).view(torch.uint8))


def test_without_a_compiler_torch_s_kernels_serve(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.load_any.__wrapped__(str(tmp_path)) is None
    assert "no C compiler found" in build.why_not()


def test_a_failing_build_leaves_no_library_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails, silently
    assert build.load_any.__wrapped__(str(tmp_path)) is None
    assert "could not build the CPU kernels: it exited with status 1 and said nothing" in build.why_not()
    assert list(tmp_path.iterdir()) == []  # no half-written library, no temporary file


def test_a_compiler_without_openmp_builds_once_and_a_killed_build_s_file_goes(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp: the one-thread build is made, named by its
    sources, and the next start loads it without building or trying -fopenmp again; a
    temporary file a killed build left behind is removed by the next build once it is old."""
    import os
    import shutil
    import time

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    wrapper = tmp_path / "cc-no-openmp"
    log = tmp_path / "calls"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase " $* " in *" -fopenmp "*) exit 1;; esac\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    folder = tmp_path / "kernels"
    folder.mkdir()
    stale = folder / ".build-killed.so"
    stale.write_bytes(b"")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert build.load_any.__wrapped__(str(folder)) is not None
    assert not stale.exists()
    calls = log.read_text().splitlines()
    with_openmp = [c for c in calls if " -fopenmp" in f" {c} "]
    # -fopenmp refused (each source tried at once), then every source and the link without it.
    assert with_openmp and len(calls) - len(with_openmp) == len(build.SOURCES) + 1
    assert build.load_any.__wrapped__(str(folder)) is not None
    assert log.read_text().splitlines() == calls  # loaded, not built or tried again
    # One library, named by its sources (and flags, compiler and CPU).
    built = sorted(p.name for p in folder.iterdir())
    assert len(built) == 1 and built[0].startswith("headroom_cpu_") and built[0].endswith(".so")


def test_the_switch_turns_them_off(tmp_path, monkeypatch):
    """``--no-cpu-kernels`` (``HEADROOM_CPU_KERNELS=0``), read at each call: no library,
    and why; the engine's loader and plan see none either."""
    from kernels.switches import using

    with using(cpu_kernels=False):
        assert build.load(str(tmp_path)) is None
        assert build.why_not() == build.SWITCHED_OFF and "HEADROOM_CPU_KERNELS=0" in build.why_not()
        assert cpu_kernels() is None


def test_the_tensor_table_reader_gives_gguf_s_own_tensors(tmp_path):
    """engine.loader.gguf_tensors against gguf.GGUFReader on the default model: the same
    names, types, shapes, offsets and data views, without parsing the vocabulary (a
    truncated file is refused with the download-again message, a foreign one as no GGUF)."""
    import gguf

    from engine.common.load_errors import CorruptWeights
    from engine.loader.default_model import default_gguf_path
    from engine.loader.gguf_tensors import open_tensors

    path = default_gguf_path()
    light, full = open_tensors(path), gguf.GGUFReader(path)
    assert light.values["general.architecture"] == "llama"
    assert len(light.tensors) == len(full.tensors) > 0
    for a, b in zip(light.tensors, full.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data[:2], b.data[:2]) and np.array_equal(a.data[-1:], b.data[-1:])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: 1 << 20])
    with pytest.raises(CorruptWeights, match="download it again"):
        open_tensors(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    with pytest.raises(CorruptWeights, match="is not a GGUF file .its first bytes are b'PK"):
        open_tensors(foreign)


def test_a_c_decode_projection_takes_one_to_three_runs_of_the_types_it_reads():
    blocks = torch.zeros(16, 36, dtype=torch.uint8)
    p = decode_layer.proj([(blocks, "Q4_K"), (blocks[:8], "Q6_K")])
    assert p.parts == 2 and list(p.rows)[:2] == [16, 8] and p.blocks[0] == blocks.data_ptr()
    for bad in ([], [(blocks, "Q4_0")] * 4, [(blocks, "Q5_1")], [(blocks, "MXFP4")]):
        with pytest.raises(ValueError, match="1 to 3 runs"):
            decode_layer.proj(bad)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_rows_dequantized_by_the_c_kernel_are_gguf_s(lib, type_name):
    """What a K-quant embedding's lookup reads (QuantEmbedding): gguf's values, on rows of
    2 blocks, an odd range of rows, one row; a range outside the blocks is refused."""
    from kernels.cpu.block_gemv import dequantize_rows

    blocks = torch.from_numpy(random_blocks(type_name, 37, 512, np.random.default_rng(8)))
    want = reference.dequantize(blocks, type_name, 512)
    assert torch.equal(dequantize_rows(lib, blocks, type_name, 0, 37), want)
    assert torch.equal(dequantize_rows(lib, blocks, type_name, 3, 20), want[3:20])
    assert torch.equal(dequantize_rows(lib, blocks, type_name, 36, 37), want[36:])
    with pytest.raises(ValueError, match="rows 30-38"):
        dequantize_rows(lib, blocks, type_name, 30, 38)
