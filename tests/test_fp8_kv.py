"""The FP8 KV cache (``--kv-cache-dtype fp8``): pages stored as float8_e4m3fn with scale
1.0, written by every store path and upcast by every attention backend, and charged at
one byte per element by the plan. On the CPU: torch's reference paths, and the Triton
kernels under the interpreter (the attention kernels over an FP8 pool beside the block
pools, in ``test_block_kv.py``)."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, INTERPRETING

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.core.footprint import make_footprint
from engine.kvcache.pool import kv_storage_dtype
from engine.loader.load import load_model
from engine.memory.plan import PlanKnobs
from kernels.attention.kv_store import FP8_MAX, gather_kv, scatter_kv

FP8 = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: a stored key or value is off by up to 2**-4 of itself.
# Through two layers of these tiny random models (float32 logits of spread ~0.8, largest
# ~2.9) the logits moved by at most 0.18 over the steps below (measured). A q8_0 block
# rounds each value to within 1/254 of its block's largest: at most 0.022 (measured);
# q4_0 to within 1/16 of it: at most 0.57.
LOGITS_ATOL = {"fp8": 0.25, "q8_0": 0.05, "q4_0": 0.75}


def test_scatter_and_gather_round_trip_clamp_to_the_fp8_range():
    buf = torch.zeros(8, 2, 4, dtype=FP8)
    x = torch.randn(3, 2, 4) * 4
    x[0, 0, 0] = 1e4  # out of e4m3's range: clamped, not NaN
    scatter_kv(buf, torch.tensor([5, 1, 2]), x)
    back = gather_kv(buf, torch.tensor([5, 1, 2]), torch.float32)
    assert back[0, 0, 0] == FP8_MAX
    x[0, 0, 0] = FP8_MAX
    torch.testing.assert_close(back, x, atol=0, rtol=2**-4)
    assert gather_kv(buf, torch.tensor([0]), torch.bfloat16).abs().sum() == 0


@pytest.mark.parametrize(("kind", "kv_cache_dtype"), [("llama", "fp8"), ("qwen3", "fp8"), ("qwen3", "q8_0"),
                                                    ("qwen3", "q4_0")])
def test_paged_logits_with_fp8_or_block_kv_stay_within_tolerance(kind, kv_cache_dtype, tmp_path, make_tiny_hf_model,
                                                                 paged_runner):
    """Prefill of two sequences, an extend over a cached prefix next to a decode row,
    then decode steps: the torch backend over an FP8 pool, or one of llama.cpp's blocks
    (``test_block_kv.py``; Qwen3's heads of 32 are one block), against a float32 pool."""
    make_tiny_hf_model(kind, tmp_path, vocab_size=128)
    model, config = load_model(tmp_path, "cpu", torch.float32)
    kv_dtype = kv_storage_dtype(kv_cache_dtype, torch.float32)
    ref = paged_runner(model, config, page_size=4, num_pages=32)
    got = paged_runner(model, config, page_size=4, num_pages=32, kv_dtype=kv_dtype)
    assert got.pool.k_buffers[0].dtype == kv_dtype
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, 128, (n,), generator=g).tolist()

    steps = [{"a": ids(7), "b": ids(13)}, {"a": ids(6), "b": ids(1)}] + [{"a": ids(1), "b": ids(1)}] * 4
    for step in steps:
        want, have = ref.step(step), got.step(step)
        torch.testing.assert_close(have, want, atol=LOGITS_ATOL[kv_cache_dtype], rtol=0)


def test_engine_greedy_with_fp8_kv_on_the_cpu(tmp_path, make_tiny_hf_model):
    """The engine serves with an FP8 pool on the CPU (pool bytes a quarter of float32's);
    its greedy tokens equal the float32 pool's over the prefill and the first decode
    steps (later ones may part at a near-tie of this random model: the logits
    themselves are bounded by the test above)."""
    from test_engine import GREEDY, run_all

    make_tiny_hf_model("llama", tmp_path)
    prompts = {f"r{i}": (list(range(3 + i, 20 + 3 * i)), GREEDY) for i in range(3)}
    base = Engine(EngineConfig(model=str(tmp_path), device="cpu", page_size=4, num_pages=128))
    fp8 = Engine(EngineConfig(model=str(tmp_path), device="cpu", page_size=4, num_pages=128, kv_cache_dtype="fp8"))
    assert fp8.pool.dtype == FP8 and fp8.pool.compute_dtype == torch.float32
    assert fp8.pool.nbytes * 4 == base.pool.nbytes
    # Without a plan (a CPU), the engine's info (/api/status's engine) still says the
    # KV cache's dtype and its bytes per token.
    assert base.plan is None and fp8.plan is None
    assert (base.info.kv_cache_dtype, fp8.info.kv_cache_dtype) == ("float32", "float8_e4m3fn")
    assert base.info.kv_bytes_per_token == 4 * fp8.info.kv_bytes_per_token > 0
    want, have = run_all(base, prompts), run_all(fp8, prompts)
    for r in prompts:
        assert len(have[r]) == len(want[r]) == GREEDY.max_new_tokens
        assert have[r][:4] == want[r][:4], (want[r], have[r])


def test_plan_charges_half_the_bytes_per_token_of_bfloat16(tmp_path, make_tiny_hf_model):
    from engine.loader.hf_config import load_model_config

    make_tiny_hf_model("llama", tmp_path)
    mc = load_model_config(tmp_path)
    bf16 = make_footprint(mc, torch.bfloat16, PlanKnobs())
    fp8 = make_footprint(mc, torch.bfloat16, PlanKnobs(kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert (fp8.kv_cache_dtype, bf16.kv_cache_dtype) == ("float8_e4m3fn", "bfloat16")


def test_headroom_plan_shows_the_kv_dtype_and_its_bytes_per_token(tmp_path, make_tiny_hf_model):
    from engine.commands.plan import build_plan, render

    make_tiny_hf_model("llama", tmp_path)
    base = dict(model=str(tmp_path), device="cuda", device_total=8 << 30, dtype="bfloat16")
    auto = build_plan(EngineConfig(**base))
    fp8 = build_plan(EngineConfig(**base, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.num_pages >= 2 * auto.num_pages - 1
    text = render(fp8, as_json=False)
    assert "float8_e4m3fn" in text and f"{fp8.kv_bytes_per_token:,} bytes per token" in text


def test_triton_rotary_store_writes_an_fp8_pool_like_the_reference():
    pytest.importorskip("triton")
    from kernels.rotary.reference import rotary_and_store as ref_store
    from kernels.rotary.triton_kernel import rotary_and_store

    g = torch.Generator().manual_seed(0)
    t, hq, hk, d = 3, 4, 2, 16
    q, k, v = (torch.randn(t, n, d, generator=g).to(DEVICE) for n in (hq, hk, hk))
    v[0, 0, 0] = 1e4  # clamped by both
    pos = torch.tensor([0, 5, 9], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(16).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).to(DEVICE)
    slots = torch.tensor([1, 6, 7], device=DEVICE)
    bufs = [torch.zeros(8, hk, d, dtype=FP8, device=DEVICE) for _ in range(4)]
    q1 = ref_store(q, k, v, pos, cache, bufs[0], bufs[1], slots)
    q2 = rotary_and_store(q, k, v, pos, cache, bufs[2], bufs[3], slots)
    torch.testing.assert_close(q2, q1)
    # Rotated keys may differ in float32's last bit before the cast: one e4m3 step at most.
    for a, b in ((bufs[0], bufs[2]), (bufs[1], bufs[3])):
        a, b = a.float(), b.float()
        if INTERPRETING:
            # Triton 3.6's interpreter converts to e4m3 in software and drops the carry
            # when rounding up reaches the next power of two (1.95 -> 1.0, not 2.0); the
            # GPU converts in hardware (tests/gpu checks it there).
            carry = (a.abs().log2() == a.abs().log2().round()) & (b == a / 2)
            b = torch.where(carry, a, b)
        torch.testing.assert_close(b, a, rtol=2**-3, atol=2**-9)
    assert bufs[3].float()[1, 0, 0] == FP8_MAX
