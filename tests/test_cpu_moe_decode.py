"""Mixture-of-experts layers through the C decode layer (:mod:`engine.layers.cpu_decode`):
the attention half in one C call, the post-attention norm's rows handed back, then the
layer's router and its experts (the C kernels), against the torch layers over the same
C kernels; the dense layers among them (``mlp_only_layers``) whole in the C layer and a
shared expert (Qwen2-MoE) run by the block. On tiny GGUFs: the benchmarks' random
Qwen3-MoE (attention Q4_K with v Q6_K, experts Q4_K/Q4_K/Q6_K), a Qwen3-MoE of a sparse
and a dense layer, and a Qwen2-MoE with its shared expert (Q8_0)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from test_engine import run_all  # noqa: E402
from test_gguf_convert import VOCAB, write_gguf  # noqa: E402
from test_gguf_moe_quant import _random_moe_gguf, write_tiny_moe_gguf  # noqa: E402

from engine.common.config import EngineConfig  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.layers.cpu_pack import pack_model_for_cpu  # noqa: E402
from engine.layers.linear.cpu_kernels import cpu_kernels  # noqa: E402
from engine.layers.moe.sparse_moe import SparseMoeBlock  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.gguf_quant import load_gguf_quantized  # noqa: E402
from engine.loader.hf_config import load_model_config  # noqa: E402
from engine.wire.messages import SamplingParams  # noqa: E402
from kernels.attention.kv_store import gather_kv  # noqa: E402


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels()
    if lib is None:
        pytest.skip("the C CPU kernels do not build here")
    return lib


def _qwen2_moe_gguf(folder, make_tiny_hf_model):
    """(path, config) of a Qwen2-MoE GGUF: layer 0 dense, layer 1 sparse with a shared expert."""
    path = folder / "tiny-qwen2moe.gguf"
    write_gguf(path, "qwen2moe", make_tiny_hf_model("qwen2_moe", None, vocab_size=VOCAB))
    return path, load_model_config(convert_gguf(path, folder / "hf"))


@pytest.fixture(scope="module", params=["qwen3moe-q4_k", "qwen3moe-dense-layer", "qwen2moe-shared"])
def tiny(request, tmp_path_factory, make_tiny_hf_model, lib):
    """A tiny MoE GGUF loaded as the CPU engine loads it (experts and projections in
    blocks, packed for the C kernels): ``(model, config)``."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3moe-q4_k":
        path, config = _random_moe_gguf(folder)
    elif request.param == "qwen3moe-dense-layer":
        path, config = write_tiny_moe_gguf(folder, make_tiny_hf_model)
    else:
        path, config = _qwen2_moe_gguf(folder, make_tiny_hf_model)
    model = load_gguf_quantized(config, path, "cpu", torch.float32)
    return pack_model_for_cpu(model, torch.float32, lib), config


def test_moe_layers_run_through_the_c_decode_layer(tiny):
    """Every layer is the C layer's: a sparse one hands its experts to its block, a dense
    one runs its MLP in C."""
    model, config = tiny
    fast = model.cpu_decode
    assert fast is not None and len(fast.specs) == config.num_layers
    for i, layer in enumerate(model.model.layers):
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        assert sparse == (i in config.moe_layers)
        assert (fast.moe[i] is layer.mlp) if sparse else fast.moe[i] is None
        assert (fast.specs[i].gate_up.parts == 0) == sparse
    assert config.moe_layers


def _steps(fast, runner) -> list[torch.Tensor]:
    """A prefill of 37 tokens and one of 3, decode steps of both together (each one ``fast``
    takes), then one alone."""
    logits = [runner.step({0: [5, 70, 3, 20, 42] * 7 + [1, 2], 1: [9, 8, 7]})]
    for tokens in ([11, 12], [13, 14], [15, 16], [17, 18]):
        logits.append(runner.step({0: [tokens[0]], 1: [tokens[1]]}))
        assert runner.last_batch.is_decode and fast.takes(runner.last_batch, logits[-1], runner.pool)
    logits.append(runner.step({1: [19]}))
    return logits


def test_the_c_moe_layer_gives_the_torch_layers_logits(tiny, paged_runner, monkeypatch):
    """The same steps through the C decode layer and through the torch layers (their
    experts by the same C kernels): logits within 1e-3 of the largest (the norms, rotary
    and attention sum in another order, and a last-bit change of an activation may move
    its 16-bit code by one) and the same KV pool; the C path ran every step, the prefill
    of both sequences (its two halves around torch's attention) and the five decode steps."""
    model, config = tiny
    fast = model.cpu_decode
    calls = []
    monkeypatch.setattr(fast, "run", lambda *a, **k: calls.append(1) or type(fast).run(fast, *a, **k))
    runs = {}
    for use in (True, False):
        model.cpu_decode = fast if use else None
        runner = paged_runner(model, config, page_size=4, num_pages=32)
        logits = _steps(fast, runner)
        runs[use] = (logits, [gather_kv(b, torch.arange(b.shape[0]), torch.float32)
                              for b in runner.pool.k_buffers + runner.pool.v_buffers])
    model.cpu_decode = fast
    assert len(calls) == 6
    for got, want in zip(runs[True][0], runs[False][0], strict=True):
        assert bool(torch.isfinite(got).all())
        assert float((got - want).abs().max()) <= 1e-3 * max(1.0, float(want.abs().max()))
    for got, want in zip(runs[True][1], runs[False][1], strict=True):
        assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


def test_the_engine_s_greedy_ids_equal_the_torch_layers(tmp_path, lib, monkeypatch):
    """The random Qwen3-MoE GGUF served by the CPU engine: greedy ids through the C decode
    layer (which ran) equal the torch layers' over the same engine."""
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = _random_moe_gguf(tmp_path)
    engine = Engine(EngineConfig(model=str(path), device="cpu", kv_cache=64 << 20))
    fast = engine.model.cpu_decode
    assert fast is not None and all(m is not None for m in fast.moe)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {"a": ([5, 70, 3, 200, 42, 42, 9, 100], greedy), "b": ([11, 12, 13], greedy)}
    calls = []
    run = fast.run
    fast.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    ours = run_all(engine, requests)
    assert calls
    engine.model.cpu_decode = None
    theirs = run_all(engine, requests)
    assert ours == theirs and all(len(ids) == 12 for ids in ours.values())
