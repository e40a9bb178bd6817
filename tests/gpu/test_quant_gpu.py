"""GGUF blocks on the GPU: the default model served from its Q4_1 blocks against the
same file dequantized at load, the kernels at Llama-3-8B projection shapes against
``gguf``'s dequantizers, and the plan's price of the blocks against the loader.

Greedy text: equal, or, where a near-tie flips a pick, the dequantized model's own
logit for our token is within ``NEAR_TIE`` of its best at the first difference
(nothing after it is compared: the contexts differ from there). The two sides hold the
same weights exactly in float32 (Q4_1 values are exact there), so only the summation
order differs; in bfloat16 the dequantized side also rounds every weight to 8 bits of
mantissa, which the blocks never do.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_fast_path_gpu import _chat_prompts, run_greedy
from test_int8_kernels import INT8_ROUNDING_TOL
from triton_interpret import run_compiler_script, skip_without_ptxas

from engine.common.config import EngineConfig
from engine.common.load_errors import ModelNotFound
from engine.core.engine import Engine
from engine.layers.linear.gguf_blocks import QuantLinear

NEW_TOKENS = 48
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.25}


def _gguf() -> str:
    path = os.environ.get("HEADROOM_TEST_GGUF")
    if path:
        return path
    from engine.loader.default_model import default_gguf_path

    try:
        return str(default_gguf_path())
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_from_q4_1_blocks_gives_the_dequantized_greedy_text(dtype, paged_runner):
    common = dict(model=_gguf(), device="cuda", dtype=dtype, kv_cache=1 << 30, max_running_requests=8)
    quant = Engine(EngineConfig(**common, gguf_quantized=True))
    linears = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert linears and {p.type_name for m in linears for p in m.parts} == {"Q4_1"}
    # The decode step with the quantized linears captures as CUDA graphs.
    assert quant.runner.graphs is not None
    # What the plan charged is what the loader placed.
    assert quant.weight_size.bytes == quant.info.weight_bytes  # the RoPE cache counted on both sides
    assert "Q4_1 blocks" in quant.weight_size.mix
    prompts = _chat_prompts(quant, 5)
    got = run_greedy(quant, prompts, new_tokens=NEW_TOKENS)
    assert quant.runner.graphs.captures >= 1
    quant_bytes = quant.info.weight_bytes
    del quant, linears
    torch.cuda.empty_cache()

    dense = Engine(EngineConfig(**common))  # the default: dequantized at load
    assert not any(isinstance(m, QuantLinear) for m in dense.model.modules())
    want = run_greedy(dense, prompts, new_tokens=NEW_TOKENS)
    print(f"\n{dtype}: weights {quant_bytes / 2**20:.1f} MiB in blocks, {dense.info.weight_bytes / 2**20:.1f} MiB "
          f"dequantized; {sum(g == w for g, w in zip(got, want, strict=True))}/5 greedy texts identical")
    for ids, g, w in zip(prompts, got, want, strict=True):
        j = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        if j is None:
            continue
        logits = paged_runner(dense.model, dense.model_config, device="cuda", num_pages=64, page_size=16).step(
            {0: ids + w[:j]})[0]
        gap = float(logits[w[j]] - logits[g[j]])
        print(f"  prompt of {len(ids)} tokens: first difference at token {j}, dequantized logit gap {gap:.4f}")
        assert gap <= NEAR_TIE[dtype], f"token {j}: blocks pick {g[j]}, dequantized {w[j]}, gap {gap:.4f}"


@pytest.mark.parametrize("type_name,n,k", [("Q4_K", 4096, 4096), ("Q6_K", 1024, 4096), ("Q6_K", 4096, 14336),
                                           ("Q6_K_P", 1024, 4096), ("Q6_K_P", 4096, 14336), ("Q4_K", 14336, 4096),
                                           ("Q5_K", 2048, 4096), ("Q4_0", 2048, 4096), ("Q4_1", 1536, 576),
                                           ("Q8_0", 576, 1536), ("Q8_0", 4096, 4096)])
def test_kernels_at_real_shapes_match_gguf_dequantize(type_name, n, k):
    """The default tilings (split-K or tuned GEMV; the tile GEMM, split-K at 40 rows; the
    weight dequantized for cuBLAS at 300) at 1, 16, 40, 80 and 300 rows. Q4_K/Q6_K
    decode rows take the int8 GEMV by default: against the reference of its rounding,
    and the exact product within the activations' int8 rounding; their float GEMV too."""
    from kernels.quant import reference
    from kernels.quant import triton_kernel as triton_quant
    from kernels.quant.int8_choice import uses_int8_dot
    from kernels.quant.synthetic import random_blocks

    rng = np.random.default_rng(n + k)
    w = torch.from_numpy(random_blocks(type_name, n, k, rng, scale=1e-3)).cuda()
    weight = reference.dequantize(w, type_name, k)
    for m in (1, 16, 40, 80, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        exact = x.float() @ weight.T
        int8 = m <= triton_quant.gemv_max_rows() and uses_int8_dot(type_name)
        out = triton_quant.quant_matmul(x, w, type_name).float()
        # bfloat16 output rounding (2^-8 relative) with room for the summation order.
        tol = INT8_ROUNDING_TOL if int8 else 2**-6
        assert float((out - exact).abs().max()) <= tol * float(exact.abs().max()), f"{m} rows"
        if int8:
            ref = reference.quant_matmul_int8(x.float(), w, type_name)
            assert float((out - ref).abs().max()) <= 2**-6 * float(ref.abs().max()), f"int8, {m} rows"
            out = triton_quant.quant_gemv(x, w, type_name, int8_dot=False).float()
            assert float((out - exact).abs().max()) <= 2**-6 * float(exact.abs().max()), f"float GEMV, {m} rows"


def test_split_k_gives_the_same_bits_every_run():
    """K split into 8 ranges, the float and packed GEMMs at 16 rows and the float and int8 GEMVs at one:
    the partial sums are added in a fixed order, so 20 runs give one result, bit for bit
    (atomic adds did not: their order, hence the rounding, changed from run to run)."""
    from kernels.quant import triton_kernel as triton_quant
    from kernels.quant.gemm_tuning import GemmTiling
    from kernels.quant.synthetic import random_blocks

    w = torch.from_numpy(random_blocks("Q4_K", 2048, 14336, np.random.default_rng(3), scale=1e-3)).cuda()
    x16, x1 = (torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16) for m in (16, 1))
    runs = {
        "gemm": lambda: triton_quant.quant_gemm(x16, w, "Q4_K", tiling=GemmTiling(), split_k=8),
        "packed gemm": lambda: triton_quant.quant_gemm(x16, w, "Q4_K", tiling=GemmTiling(packed=True), split_k=8),
        "gemv": lambda: triton_quant.quant_gemv(x1, w, "Q4_K", int8_dot=False, block_n=4, split_k=8),
        "int8 gemv": lambda: triton_quant.quant_gemv(x1, w, "Q4_K", int8_dot=True, block_n=4, split_k=8),
    }
    for name, run in runs.items():
        first = run()
        assert all(torch.equal(run(), first) for _ in range(20)), name


def _tiling(config) -> dict:
    """A tuned config as :func:`kernels.quant.triton_int8.int8_gemv`'s forced tiling."""
    return dict(block_n=config.kwargs["BLOCK_N"], blocks_per_step=config.kwargs["KB"], num_warps=config.num_warps,
                split_k=1, variant={v: config.kwargs[v] for v in ("SPLIT", "PREFETCH") if v in config.kwargs})


@pytest.mark.parametrize("type_name,n,k", [("Q4_K", 4096, 4096), ("Q4_K", 14336, 4096), ("Q4_K", 28672, 4096),
                                           ("Q6_K_P", 4096, 14336), ("Q6_K_P", 1024, 4096), ("Q6_K", 4096, 14336),
                                           ("Q6_K_P", 256, 4096)])
def test_int8_gemv_quantizing_its_rows_equals_quantizing_apart_at_real_shapes(type_name, n, k):
    """At the 8B projection shapes, 1 and 16 rows, bfloat16 and float32: the int8 GEMV
    given the float rows (quantizing them as it reads them, one launch) equals it given
    their codes from ``quantize_activations`` at the same tiling, to summation order
    (bit for bit in Triton's interpreter, tests/test_quant_kernels.py): the autotuner's
    pick for the one-launch kernel, and split-K (256 rows) at a forced two-way split."""
    from kernels.quant import triton_activations, triton_int8
    from kernels.quant.formats import block_format
    from kernels.quant.split_k import sm_count
    from kernels.quant.synthetic import random_blocks

    rng = np.random.default_rng(n + k + 1)
    w = torch.from_numpy(random_blocks(type_name, n, k, rng, scale=1e-3)).cuda()
    tuned = n >= 2 * sm_count(0)
    for m in (1, 16):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            x[0, :32] = 0  # a group of zeros: scale 0
            q8 = triton_activations.quantize_activations(x)
            if tuned:
                fused = triton_int8.int8_gemv(x, w, type_name)
                code = block_format(type_name).code
                picked = [c for key, c in triton_int8._tuned.cache.items()
                          if tuple(key[:6]) == (n, k, code, True, 0, 0) and str(dtype) in key]
                assert picked, f"no tuned config for {n}x{k} {type_name}"
                tiling = _tiling(picked[0])
            else:
                tiling = dict(block_n=4, blocks_per_step=2, split_k=2)
                fused = triton_int8.int8_gemv(x, w, type_name, **tiling)
            apart = triton_int8.int8_gemv(q8, w, type_name, **tiling)
            # The same codes, scales and products; the compiled kernel may add the
            # partial sums in another order (Q4_K's did on sm_90), so the outputs agree
            # to float32 summation order, then the output dtype's last bit.
            tol = (2**-7 if dtype == torch.bfloat16 else 1e-5) * float(apart.float().abs().max())
            for got in (fused, triton_int8.int8_gemv(x, w, type_name, **tiling)):
                diff = float((got.float() - apart.float()).abs().max())
                assert diff <= tol, f"{m} rows {dtype}, {tiling}: max |diff| {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("first,second", [(("Q4_K", 5120), ("Q6_K_P", 1024)), (("Q4_K", 2048), ("Q6_K", 1024))])
def test_int8_gemv_of_two_parts_in_one_launch_equals_a_launch_each(first, second):
    """The 8B q/k/v projection of a Q4_K_M file (q and k in Q4_K over v in Q6_K planes;
    GGUF's Q6_K blocks too), 1 and 16 bfloat16 rows, float rows and their codes: the
    one launch for both parts (autotuned) equals each part's own launch at the tiling
    it picked, bit for bit."""
    from kernels.quant import triton_activations, triton_int8
    from kernels.quant.formats import block_format
    from kernels.quant.synthetic import random_blocks

    k = 4096
    rng = np.random.default_rng(3)
    parts = [(torch.from_numpy(random_blocks(t, n, k, rng, scale=1e-3)).cuda(), t) for t, n in (first, second)]
    key = (first[1], k, block_format(first[0]).code, True, second[1], block_format(second[0]).code)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for rows in (x, triton_activations.quantize_activations(x)):
            one = triton_int8.int8_gemv_parts(rows, parts)
            quant_x = rows is x
            picked = [c for cache_key, c in triton_int8._tuned.cache.items()
                      if tuple(cache_key[:6]) == key[:3] + (quant_x,) + key[4:]]
            assert picked, f"no tuned config for {key}"
            each = torch.cat([triton_int8.int8_gemv(rows, w, t, **_tiling(picked[0])) for w, t in parts], dim=1)
            assert torch.equal(one, each), f"{m} rows, {'floats' if quant_x else 'codes'}, {picked[0]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 16])
def test_producers_quantize_as_the_quantizing_launch_at_real_shapes(dtype, m):
    """The 8B model's norms (hidden 4096; 5120 too, padding groups in the row's block)
    and SiLU-and-mul (intermediate 14336, 14 programs a row) with ``quantize=True``,
    compiled: the same output as without, bit for bit, and the codes, scales and sums of
    ``quantize_activations`` of that output bit for bit (compared directly: the GEMV's
    outputs from them may differ in summation order between launches on sm_90)."""
    from kernels.activation import triton_kernel as triton_activation
    from kernels.norm import triton_kernel as triton_norm
    from kernels.quant import triton_activations

    def same_codes(q8, out):
        want = triton_activations.quantize_activations(out.reshape(-1, out.shape[-1]))
        return all(torch.equal(getattr(q8, f), getattr(want, f)) for f in ("codes", "scales", "sums"))

    g = torch.Generator(device="cuda").manual_seed(m)
    for h in (4096, 5120):
        x = (torch.randn(m, h, device="cuda", generator=g) * 3).to(dtype)
        x[0, :32] = 0  # a group of zeros: scale 0
        res = torch.randn(m, h, device="cuda", generator=g).to(dtype)
        w = torch.randn(h, device="cuda", generator=g).to(dtype)
        out, q8 = triton_norm.rms_norm(x, w, 1e-5, quantize=True)
        assert torch.equal(out, triton_norm.rms_norm(x, w, 1e-5)) and same_codes(q8, out), f"rms_norm {h}"
        res_plain = res.clone()
        plain, _ = triton_norm.fused_add_rms_norm(x, res_plain, w, 1e-5)
        out, _, q8 = triton_norm.fused_add_rms_norm(x, res, w, 1e-5, quantize=True)
        assert torch.equal(res, res_plain) and torch.equal(out, plain), f"fused_add_rms_norm {h}"
        assert same_codes(q8, out), f"fused_add_rms_norm {h}"
    gate_up = (torch.randn(m, 2 * 14336, device="cuda", generator=g) * 3).to(dtype)
    out, q8 = triton_activation.silu_and_mul(gate_up, quantize=True)
    assert torch.equal(out, triton_activation.silu_and_mul(gate_up)) and same_codes(q8, out)


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_decode_hands_the_norms_codes_to_the_int8_gemv(tmp_path, paged_runner, monkeypatch, attention):
    """Two layers of the benchmark's 8B Q4_K_M-like file, bfloat16, a prefill of as many
    tokens as the GEMV takes (rows above it run the block GEMM, which takes no int8
    rows), then 1 token: every int8 row a producer hands a projection (q/k/v, gate/up and down a
    layer, the LM head; o's too from the Triton attention's split merge at the 1-token
    step) equals ``quantize_activations`` of the rows it wrote, bit for bit, and the
    logits equal those with ``--no-quant-int8-producer`` to the GEMVs' summation
    order."""
    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_gguf
    from engine.loader.gguf_quant import load_gguf_quantized
    from engine.loader.hf_config import load_model_config
    from kernels.quant import triton_activations
    from kernels.quant.triton_kernel import gemv_max_rows
    from kernels.switches import using

    config = load_model_config(write_shape("llama-3.1-8b", tmp_path / "cfg", num_hidden_layers=2, vocab_size=16384))
    path = tmp_path / "k.gguf"
    write_random_gguf(path, config, np.random.default_rng(0))
    model = load_gguf_quantized(config, path, "cuda", torch.bfloat16)
    handed = []
    forward = QuantLinear.forward

    def checked(self, x, q8=None):
        if q8 is not None:
            want = triton_activations.quantize_activations(x.reshape(-1, self.in_features))
            handed.append(all(torch.equal(getattr(q8, f), getattr(want, f)) for f in ("codes", "scales", "sums")))
        return forward(self, x, q8)

    monkeypatch.setattr(QuantLinear, "forward", checked)
    logits = {}
    for producer in (True, False):
        handed.clear()
        with using(quant_int8_fuse=False, quant_int8_producer=producer):
            runner = paged_runner(model, config, device="cuda", num_pages=32, page_size=16, attention=attention)
            logits[producer] = [runner.step({0: list(range(1, gemv_max_rows() + 1))}), runner.step({0: [5]})]
        handed_o = config.num_layers if attention == "triton" else 0
        assert handed == ([True] * (2 * (3 * config.num_layers + 1) + handed_o) if producer else []), handed
    for on, off in zip(logits[True], logits[False], strict=True):
        assert bool(torch.isfinite(on).all())
        diff = float((on - off).abs().max())
        assert diff <= 2**-6 * float(off.abs().max()), f"max |diff| {diff:.3g}"


def test_benchmark_weights_take_their_block_bytes(tmp_path):
    """Two layers of the benchmark's Llama-3-8B-shape Q4_K/Q6_K file: the device holds
    the file's blocks (Q4_K 4.5 and Q6_K 6.56 bits a weight against bfloat16's 16; the
    Q6_K LM head weighs most in two layers), and the plan's price equals it."""
    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_gguf
    from engine.layers.weight_census import model_weight_bytes
    from engine.loader.gguf_quant import gguf_weight_size, load_gguf_quantized
    from engine.loader.hf_config import load_model_config

    config = load_model_config(write_shape("llama-3.1-8b", tmp_path / "cfg", num_hidden_layers=2))
    path = tmp_path / "k.gguf"
    write_random_gguf(path, config, np.random.default_rng(0))
    model = load_gguf_quantized(config, path, "cuda", torch.bfloat16)
    types = {p.type_name for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts}
    assert types == {"Q4_K", "Q6_K_P"}  # Q6_K repacked on CUDA (v, down, the LM head), same bytes
    blocks = sum(b.nbytes for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers())
    dense_projections = sum(m.out_features * m.in_features * 2 for m in model.modules() if isinstance(m, QuantLinear))
    assert blocks < 0.42 * dense_projections
    size = gguf_weight_size(path, config, torch.bfloat16)
    assert size.bytes == model_weight_bytes(model)


def test_every_block_type_compiles_for_hopper_without_register_spills():
    """The sweep the CPU suite leaves out (it compiles one K-quant and one legacy type,
    ``tests/test_quant_kernels.py``): every block type's GEMV (1 and 16 rows) and GEMM
    (bfloat16, float32) compiles for sm_90 with no stack frame (see
    ``triton_quant_compile_check.py``), a process per type, as many at once as the host
    has cores (one after the other it took over 6 minutes on an H100 host)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.quant.formats import FORMATS, REPACKED

    skip_without_ptxas()
    types = [*FORMATS, *REPACKED]
    with ThreadPoolExecutor(max_workers=max(1, min(len(types), os.cpu_count() or 1))) as pool:
        runs = list(pool.map(lambda t: run_compiler_script("triton_quant_compile_check.py", timeout=1200,
                                                           args=(t,)), types))
    for type_name, done in zip(types, runs, strict=True):
        assert done.returncode == 0, (type_name, done.stdout + done.stderr)
        assert "quant kernels ok" in done.stdout
        assert f"gemm {type_name} " in done.stdout
