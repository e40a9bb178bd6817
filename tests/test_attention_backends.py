"""Attention backends behind the registry: the Triton backend against the torch one
through the whole model (on the CPU under Triton's interpreter), the ``kv_stored``
contract, and how ``auto`` resolves."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import INTERPRETING

from engine.attention.base import BACKEND_CHOICES, backend_class, resolve_backend_name
from engine.loader.load import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory, make_tiny_hf_model):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_hf_model(request.param, path, vocab_size=128)
    model, config = load_model(path, "cuda" if not INTERPRETING else "cpu", torch.float32)
    return model, config


def _with_backend(runner, name: str, config):
    runner.attn = backend_class(name)(
        runner.pool, num_heads=config.num_heads, head_dim=config.head_dim, scale=config.head_dim**-0.5, max_batch=4
    )
    return runner


def test_triton_backend_matches_torch_through_the_model(tiny, paged_runner):
    """Prefill of two sequences in one launch, then a step mixing a chunk over a cached
    prefix with a decode row, then decode steps: logits equal the torch backend's."""
    pytest.importorskip("triton")
    model, config = tiny
    if INTERPRETING:
        ref = paged_runner(model, config, page_size=4, num_pages=32)
        got = _with_backend(paged_runner(model, config, page_size=4, num_pages=32), "triton", config)
    else:
        pytest.skip("covered on CUDA by tests/gpu")
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, 128, (n,), generator=g).tolist()

    steps = [
        {"a": ids(7), "b": ids(13)},  # prefill, odd lengths across pages
        {"a": ids(6), "b": ids(1)},  # extend over a cached prefix next to a decode row
        {"a": ids(1), "b": ids(1)},  # decode
        {"a": ids(1), "b": ids(1)},
    ]
    for step in steps:
        want = ref.step(step)
        have = got.step(step)
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)


def test_kv_stored_skips_the_backends_store(tiny, paged_runner):
    """With ``kv_stored=True`` the backend attends over what the caller wrote and writes
    nothing itself."""
    from engine.forward_batch import ForwardBatch

    model, config = tiny
    runner = paged_runner(model, config, page_size=4, num_pages=8)
    attn, pool = runner.attn, runner.pool
    dev = pool.device
    t, hq, hk, d = 3, config.num_heads, config.num_kv_heads, config.head_dim
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, hq, d, generator=g).to(dev)
    k = torch.randn(t, hk, d, generator=g).to(dev)
    v = torch.randn(t, hk, d, generator=g).to(dev)
    batch = ForwardBatch(
        is_decode=False, input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
        positions=torch.arange(t, device=dev), out_slots=torch.arange(4, 4 + t, device=dev),
        page_table=torch.tensor([[1]], device=dev), prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([t]),
        logits_indices=torch.tensor([t - 1], device=dev),
    )
    attn.prepare(batch)
    stored = attn.forward(q, k, v, 0, batch)  # stores, then attends
    garbage = torch.full_like(k, 7.0)
    again = attn.forward(q, garbage, garbage, 0, batch, kv_stored=True)
    torch.testing.assert_close(again, stored)
    torch.testing.assert_close(pool.k_buffers[0][4 : 4 + t], k)  # the garbage was not written


def test_auto_resolves_per_device_and_bad_names_say_the_fix():
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend_name("triton", "cpu")
    with pytest.raises(ValueError, match="choose one of auto, triton, flashinfer, torch"):
        resolve_backend_name("xformers", "cuda")
    assert set(BACKEND_CHOICES) == {"auto", "triton", "flashinfer", "torch"}


def test_backends_declare_their_workspace():
    pytest.importorskip("triton")
    torch_ws = backend_class("torch").workspace_size(num_heads=16, num_kv_heads=8, head_dim=128, max_batch=64)
    triton_ws = backend_class("triton").workspace_size(num_heads=16, num_kv_heads=8, head_dim=128, max_batch=64)
    fi_ws = backend_class("flashinfer").workspace_size(num_heads=16, num_kv_heads=8, head_dim=128, max_batch=64)
    assert torch_ws == 0
    assert 0 < triton_ws < 64 << 20  # split-K partials: megabytes, not a pool's worth
    assert fi_ws == (128 + 2 * 8) << 20  # float workspace + two wrappers' integer workspaces


def test_fast_path_options_reach_the_engine_config(tmp_path):
    from service.cli.settings import SettingsError, resolve

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    ec = resolve({"attention_backend": "flashinfer", "cuda_graphs": False, "cuda_graph_max_batch": 8},
                 env={}, config_path=empty).engine_config()
    assert (ec.attention_backend, ec.cuda_graphs, ec.cuda_graph_max_batch) == ("flashinfer", False, 8)
    default = resolve({}, env={"HEADROOM_CUDA_GRAPHS": "on"}, config_path=empty).engine_config()
    assert (default.attention_backend, default.cuda_graphs, default.cuda_graph_max_batch) == ("auto", True, 64)
    with pytest.raises(SettingsError, match="--attention-backend: .*not one of auto, triton, flashinfer, torch"):
        resolve({"attention_backend": "xformers"}, env={}, config_path=empty)
    with pytest.raises(SettingsError, match="--cuda-graph-max-batch: .*--no-cuda-graphs"):
        resolve({"cuda_graph_max_batch": 0}, env={}, config_path=empty)
