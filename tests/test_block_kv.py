"""The KV cache in llama.cpp's blocks (``--kv-cache-dtype q8_0`` and ``q4_0``): pages
written as llama.cpp's quantizer writes them, read by the torch backend (the rows a step
gathers, dequantized) and by the Triton kernels (tile by tile, in Triton's interpreter on
the CPU), priced by the plan at the blocks' bytes, and the default model's greedy text
against the float cache's."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import torch
from near_tie import assert_near_ties
from test_engine import PROMPTS, run_all
from triton_interpret import DEVICE, INTERPRETING

from engine.common.config import EngineConfig
from engine.common.errors import SettingRefused
from engine.core.engine import Engine
from engine.core.footprint import make_footprint
from engine.kvcache.pool import KVPool
from engine.loader.default_model import default_gguf_path
from engine.loader.hf_config import load_model_config
from engine.memory.plan import PlanKnobs
from engine.text.chat import encode_chat
from engine.text.tokenizer import load_tokenizer
from engine.wire.messages import SamplingParams
from kernels.attention.kv_store import (
    BLOCK_KV_DTYPES,
    FP8_KV_DTYPE,
    dequantize_blocks,
    gather_kv,
    quantize_blocks,
    scatter_kv,
)

FORMATS = list(BLOCK_KV_DTYPES)


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_llama_cpp_s_bytes(fmt):
    """The store writes what gguf's (llama.cpp's reference) quantizer writes, byte for
    byte, and the gather reads back gguf's dequantized values; an all-zero block too."""
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 64, generator=g) * torch.logspace(-3, 2, 64)
    x[0, 0, :32] = 0
    buf = torch.zeros(10, 2, 64 // 32 * (34 if fmt == "q8_0" else 18), dtype=BLOCK_KV_DTYPES[fmt])
    slots = torch.tensor([9, 1, 2, 3, 5, 7])
    scatter_kv(buf, slots, x)
    want = gguf.quants.quantize(x.reshape(-1, 64).numpy(), qtype)
    assert np.array_equal(buf[slots].view(torch.uint8).reshape(12, -1).numpy(), want)
    back = gather_kv(buf, slots, torch.float32)
    assert torch.equal(back, torch.from_numpy(gguf.quants.dequantize(want, qtype)).view(6, 2, 64))
    assert gather_kv(buf, torch.tensor([0]), torch.bfloat16).abs().sum() == 0  # an unwritten slot reads 0


def _random_pool(fmt, g, slots, hk, d):
    x = torch.randn(slots, hk, d, generator=g)
    plain = {"fp8": FP8_KV_DTYPE, "f16": torch.float16}
    return (x.to(plain[fmt]) if fmt in plain else quantize_blocks(x, fmt)).to(DEVICE)


@pytest.mark.parametrize("fmt", ["fp8", "f16", *FORMATS])
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_triton_attention_reads_an_fp8_f16_or_block_pool(kernel, fmt):
    """The Triton kernels upcast an FP8 or a float16 pool, and dequantize each tile of blocks, as
    they load it: equal to the torch reference over the same pool, whose gather upcasts
    or dequantizes the rows it reads. Head dim 64 (two blocks a row), grouped heads,
    pages out of order."""
    pytest.importorskip("triton")
    from kernels.attention.reference import paged_decode_ref, paged_extend_ref
    from kernels.attention.triton_kernel import paged_decode, paged_extend

    g = torch.Generator().manual_seed(0)
    ps, hk, h, d, pages = 4, 2, 4, 64, 12
    k, v = _random_pool(fmt, g, pages * ps, hk, d), _random_pool(fmt, g, pages * ps, hk, d)
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], device=DEVICE)
    dtype = torch.float32 if INTERPRETING else torch.bfloat16
    if kernel == "decode":
        q = torch.randn(2, h, d, generator=g).to(dtype).to(DEVICE)
        lens = torch.tensor([9, 14], device=DEVICE)
        want = paged_decode_ref(q, k, v, table, lens, ps, d**-0.5)
        have = paged_decode(q, k, v, table, lens, ps, d**-0.5)
    else:
        ext = [3, 5]
        q = torch.randn(sum(ext), h, d, generator=g).to(dtype).to(DEVICE)
        starts, prefix, extend = (torch.tensor(x, device=DEVICE) for x in ([0, 3], [6, 9], ext))
        want = paged_extend_ref(q, k, v, table, starts, prefix, extend, ps, d**-0.5)
        have = paged_extend(q, k, v, table, starts, prefix, extend, ps, d**-0.5, max_extend=5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(have.float(), want.float(), atol=tol, rtol=tol)
    # The reference attends over the dequantized values: not over the zeros of a page
    # misread, nor the raw codes.
    assert want.abs().max() > 0.1 and gather_kv(k, torch.arange(4, device=DEVICE), torch.float32).abs().max() < 10


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_rotary_store_writes_a_block_pool_like_the_reference(fmt):
    """The fused rotary + store launch quantizes into a block pool as the torch store
    does: the values equal and the keys (rotated; float32's last bit may differ before
    quantizing) within one code of each other."""
    pytest.importorskip("triton")
    from kernels.rotary.reference import rotary_and_store as ref_store
    from kernels.rotary.triton_kernel import rotary_and_store

    g = torch.Generator().manual_seed(0)
    t, hq, hk, d = 3, 4, 2, 64
    q, k, v = (torch.randn(t, n, d, generator=g).to(DEVICE) for n in (hq, hk, hk))
    pos = torch.tensor([0, 5, 9], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(16).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).to(DEVICE)
    slots = torch.tensor([1, 6, 7], device=DEVICE)
    width = d // 32 * (34 if fmt == "q8_0" else 18)
    bufs = [torch.zeros(8, hk, width, dtype=BLOCK_KV_DTYPES[fmt], device=DEVICE) for _ in range(4)]
    q1 = ref_store(q, k, v, pos, cache, bufs[0], bufs[1], slots)
    q2 = rotary_and_store(q, k, v, pos, cache, bufs[2], bufs[3], slots)
    torch.testing.assert_close(q2, q1)
    assert torch.equal(bufs[3], bufs[1])
    a, b = (dequantize_blocks(x, torch.float32) for x in (bufs[0], bufs[2]))
    step = k.abs().amax() / (127 if fmt == "q8_0" else 7)
    assert (a - b).abs().max() <= step * 1.01 and a.abs().max() > 0



@pytest.mark.parametrize("fmt", FORMATS)
def test_a_block_pool_copies_and_resizes_its_pages_as_any_other(fmt):
    """A slot is one row of bytes: the pool's page copies (a live shrink's moves) and
    resizes keep a page's blocks, and the pool's size is its blocks' bytes."""
    pool = KVPool(num_layers=2, num_pages=6, page_size=4, num_kv_heads=2, head_dim=64,
                  dtype=BLOCK_KV_DTYPES[fmt], device="cpu", compute_dtype=torch.float32)
    assert pool.nbytes == 6 * KVPool.bytes_per_page(num_layers=2, page_size=4, num_kv_heads=2, head_dim=64,
                                                    dtype=BLOCK_KV_DTYPES[fmt])
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(2))
    pool.store(1, torch.arange(20, 24), x, -x)  # page 5
    want = gather_kv(pool.k_buffers[1], torch.arange(20, 24), torch.float32)
    assert float((want - x).abs().max()) <= float(x.abs().max()) / (7 if fmt == "q4_0" else 127)
    pool.copy_pages([5], [2])
    pool.resize(3)
    pool.resize(8)
    assert torch.equal(gather_kv(pool.k_buffers[1], torch.arange(8, 12), torch.float32), want)
    assert torch.equal(gather_kv(pool.v_buffers[1], torch.arange(8, 12), torch.float32), -want)
    assert gather_kv(pool.k_buffers[1], torch.arange(20, 32), torch.float32).abs().sum() == 0  # grown pages are zero

# -- the default model and the plan -------------------------------------------------------------------


def _engine(kv_cache_dtype: str) -> Engine:
    """The default model on the CPU, prefill in chunks of 16 tokens (the chat prompts
    take two or three), its float32 cache or one of blocks."""
    return Engine(EngineConfig(model=str(default_gguf_path()), device="cpu", kv_cache=128 << 20,
                               max_prefill_tokens=16, kv_cache_dtype=kv_cache_dtype))


@pytest.fixture(scope="module")
def float_cache():
    return _engine("auto")


@pytest.fixture(scope="module")
def chat_prompts(default_model_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(default_model_dir)
    return [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


# A head's row of 32 values: its width in the pool dtype's elements, and its bytes.
@pytest.mark.parametrize(("fmt", "dtype", "width", "bytes32"), [("q8_0", torch.int8, 34, 34),
                                                               ("f16", torch.float16, 32, 64)])
def test_default_model_greedy_with_a_smaller_cache_follows_the_float_cache(float_cache, chat_prompts, fmt, dtype,
                                                                           width, bytes32, monkeypatch):
    """The 5 greedy chat prompts, 16 tokens each, prefilled in chunks (a chunk attends
    over the blocks its predecessors stored), then again from the prefix cache (the
    prompts' full pages are read back as blocks, the rest prefilled over them): each
    answer starts with the float cache's first token and, where it parts from the float
    cache's answer, the float cache itself was near a tie (:mod:`near_tie`). The same for
    a float16 pool (``f16``, llama.cpp's default cache: half the float32 pool's bytes).
    Every decode step's layers run in the C decode layer over the pool as it is."""
    from kernels.cpu import decode_layer

    pools = []  # the storage dtype of each C decode layer call's pool
    run = decode_layer.run
    monkeypatch.setattr(decode_layer, "run", lambda lib, spec, st, h, residual, k_cache, *a, **k:
                        pools.append(k_cache.dtype) or run(lib, spec, st, h, residual, k_cache, *a, **k))
    small = _engine(fmt)
    mc = small.model_config
    assert small.pool.k_buffers[0].dtype == dtype and small.pool.k_buffers[0].shape[-1] == mc.head_dim // 32 * width
    assert small.info.kv_cache_dtype == {"f16": "float16"}.get(fmt, fmt) and small.pool.compute_dtype == torch.float32
    assert small.info.kv_bytes_per_token * 128 == float_cache.info.kv_bytes_per_token * bytes32
    assert min(len(p) for p in chat_prompts) > 16  # every prompt prefilled in chunks
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    theirs = run_all(float_cache, {f"p{i}": (ids, sampling) for i, ids in enumerate(chat_prompts)})
    pools.clear()
    for round_ in ("first", "cached"):
        hits = small.stats().prefix_hit_tokens
        ours = run_all(small, {f"{round_}{i}": (ids, sampling) for i, ids in enumerate(chat_prompts)})
        if round_ == "cached":
            assert small.stats().prefix_hit_tokens - hits >= sum((len(p) - 1) // 16 * 16 for p in chat_prompts)
        answers = [ours[f"{round_}{i}"] for i in range(len(chat_prompts))]
        assert [a[0] for a in answers] == [theirs[f"p{i}"][0] for i in range(len(chat_prompts))]
        parted = [i for i, a in enumerate(answers) if a != theirs[f"p{i}"]]
        assert len(parted) <= 2, round_
        assert_near_ties(float_cache, [chat_prompts[i] for i in parted], [answers[i] for i in parted],
                         f"{fmt}-{round_}")
    # 15 decode steps a prompt and round at least (rows batched together), 30 layers each.
    assert len(pools) >= 15 * mc.num_layers and set(pools) == {dtype}


@pytest.mark.parametrize(("fmt", "block_bytes"), [("q8_0", 34), ("q4_0", 18)])
def test_plan_prices_a_block_cache_at_its_blocks_bytes(default_model_dir, fmt, block_bytes):
    """Bytes per token: ``block_bytes`` per 32 keys or values (q8_0: 34 against
    bfloat16's 64, 0.53x), in the footprint, ``headroom plan``'s text and the pool the
    engine would hold."""
    from engine.commands.plan import build_plan, render

    mc = load_model_config(default_model_dir)
    values = 2 * mc.num_kv_layers * mc.num_kv_heads * mc.head_dim
    bf16 = make_footprint(mc, torch.bfloat16, PlanKnobs())
    blocks = make_footprint(mc, torch.bfloat16, PlanKnobs(kv_cache_dtype=fmt))
    assert bf16.kv_bytes_per_token == 2 * values
    assert blocks.kv_bytes_per_token == values // 32 * block_bytes
    assert blocks.kv_bytes_per_token * 64 == bf16.kv_bytes_per_token * block_bytes
    assert (blocks.kv_cache_dtype, bf16.kv_cache_dtype) == (fmt, "bfloat16")
    assert KVPool.bytes_per_page(num_layers=mc.num_kv_layers, page_size=16, num_kv_heads=mc.num_kv_heads,
                                 head_dim=mc.head_dim, dtype=BLOCK_KV_DTYPES[fmt]) == 16 * blocks.kv_bytes_per_token
    base = dict(model=default_model_dir, device="cuda", device_total=8 << 30, dtype="bfloat16")
    plan = build_plan(EngineConfig(**base, kv_cache_dtype=fmt))
    text = render(plan, as_json=False)
    assert plan.kv_bytes_per_token == blocks.kv_bytes_per_token
    assert f"{plan.kv_bytes_per_token:,} bytes per token" in text and f"({fmt})" in text


def test_an_f16_cache_is_two_bytes_a_value_on_every_device(default_model_dir):
    """``f16``: a float32 model's (the CPU's) pool in float16, half of ``auto``'s bytes
    in the footprint and ``headroom plan --device cpu --device-total``; a 16-bit model keeps its
    own dtype (its attention reads what it always reads), the bytes ``auto`` gives."""
    from engine.commands.plan import build_plan, render
    from engine.kvcache.pool import kv_storage_dtype

    mc = load_model_config(default_model_dir)
    f32, f16 = (make_footprint(mc, torch.float32, PlanKnobs(kv_cache_dtype=k)) for k in ("auto", "f16"))
    assert f16.kv_bytes_per_token * 2 == f32.kv_bytes_per_token and f16.kv_cache_dtype == "float16"
    bf16 = make_footprint(mc, torch.bfloat16, PlanKnobs(kv_cache_dtype="f16"))
    assert bf16.kv_bytes_per_token == f16.kv_bytes_per_token and bf16.kv_cache_dtype == "bfloat16"
    assert [kv_storage_dtype("f16", d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [
        torch.float16, torch.bfloat16, torch.float16]
    plan = build_plan(EngineConfig(model=default_model_dir, device="cpu", device_total=4 << 30, kv_cache_dtype="f16"))
    assert plan.kv_bytes_per_token == f16.kv_bytes_per_token
    assert "(float16)" in render(plan, as_json=False)


def test_a_backend_without_blocks_is_refused_before_the_weights_load(default_model_dir):
    with pytest.raises(SettingRefused, match="--attention-backend flashinfer cannot read a KV cache of "
                                             "--kv-cache-dtype q8_0; use --attention-backend triton or torch"):
        Engine(EngineConfig(model=default_model_dir, device="cpu", kv_cache_dtype="q8_0",
                            attention_backend="flashinfer"))


def test_headroom_serve_answers_a_chat_over_a_q8_0_cache(start_server):
    """``headroom serve --kv-cache-dtype q8_0``: the worker's pool is in blocks
    (``/api/status`` says so, with its bytes per token) and a chat is answered."""
    server = start_server(["--kv-cache-dtype", "q8_0", "--num-pages", "256"])
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        engine = http.get("/api/status").json()["engine"]["info"]
        assert engine["kv_cache_dtype"] == "q8_0"
        assert engine["kv_bytes_per_token"] % 34 == 0 and engine["kv_bytes_per_token"] > 0
        r = http.post("/v1/chat/completions", json={
            "model": engine["model_name"], "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    assert answer["message"]["content"].strip() and r.json()["usage"]["completion_tokens"] <= 12


def test_heads_that_are_not_whole_blocks_are_refused_before_anything_loads(tmp_path, make_tiny_hf_model):
    """The tiny Llama's heads of 16 values are not a block of 32: refused by the checks
    ``headroom serve`` runs before its port opens (and the engine at load)."""
    from engine.core.settings_fit import check_for_model

    make_tiny_hf_model("llama", tmp_path)
    mc = load_model_config(tmp_path)
    check_for_model(EngineConfig(model=str(tmp_path), kv_cache_dtype="fp8"), mc)
    with pytest.raises(SettingRefused, match="--kv-cache-dtype q4_0 stores each head in blocks of 32 values; this "
                                             "model's head dim 16 is not a multiple of 32: use --kv-cache-dtype auto"):
        check_for_model(EngineConfig(model=str(tmp_path), kv_cache_dtype="q4_0"), mc)


@pytest.mark.parametrize("command", [["plan", "--device", "cpu"], ["plan", "--device", "cpu", "--device-total", "4GiB"],
                                     ["serve", "--port", "0"]])
def test_plan_and_serve_refuse_heads_that_are_not_whole_blocks_before_anything(tmp_path, make_tiny_hf_model, command):
    """``headroom plan`` on the CPU without ``--device-total`` (the host memory the engine
    would hold) refuses what ``serve`` refuses, rather than pricing blocks it cannot store;
    ``serve`` bound its port and spawned its worker, which then failed: it runs the same
    check before its port opens."""
    from click.testing import CliRunner

    from service.cli.commands import main

    make_tiny_hf_model("llama", tmp_path)
    result = CliRunner().invoke(main, [*command, "--model", str(tmp_path), "--kv-cache-dtype", "q8_0"],
                                env={"HEADROOM_CONFIG": os.devnull})
    assert result.exit_code == 2, result.output
    assert "listening" not in result.output
    assert "head dim 16 is not a multiple of 32: use --kv-cache-dtype auto or fp8" in result.output


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("hk", "d"), [(2, 64), (3, 96), (8, 128)])
def test_triton_store_writes_the_torch_store_s_bytes(fmt, hk, d):
    """The Triton store of a block pool writes the bytes of the torch store (llama.cpp's
    quantizer): an all-zero block, a block whose largest magnitude is negative and one
    where two values tie for it; 3 blocks a row (not a power of two) and bfloat16 rows;
    8 heads of 128, where compiled for an H200 two masked byte stores of the scale wrote 0
    for its low byte (on a GPU, ``DEVICE`` is CUDA)."""
    pytest.importorskip("triton")
    from kernels.attention import triton_kv_store

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, hk, d, generator=g) * torch.logspace(-4, 2, d)
    x[0, 0, :32] = 0
    x[1, 0, 5] = -1e3
    x[2, 1, 3], x[2, 1, 20] = 50.0, -50.0
    slots = torch.tensor([7, 1, 4, 9, 2])
    for rows in (x, x.to(torch.bfloat16)):
        want, have = (torch.zeros(12, hk, d // 32 * (34 if fmt == "q8_0" else 18), dtype=BLOCK_KV_DTYPES[fmt])
                      for _ in range(2))
        scatter_kv(want, slots, rows)
        have = have.to(DEVICE)
        triton_kv_store.scatter_kv(have, slots.to(DEVICE), rows.to(DEVICE))
        assert torch.equal(have.cpu(), want)
