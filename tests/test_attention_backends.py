"""Attention backends behind the registry: the Triton backend against the torch one
through the whole model (on the CPU under Triton's interpreter), the ``kv_stored``
contract, and how ``auto`` resolves."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import INTERPRETING

from engine.layers.attention.registry import BACKEND_CHOICES, backend_class, resolve_backend_name
from engine.loader.load import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])  # gemma3: sliding windows of 8
def tiny(request, tmp_path_factory, make_tiny_hf_model):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_hf_model(request.param, path, vocab_size=128)
    model, config = load_model(path, "cuda" if not INTERPRETING else "cpu", torch.float32)
    return model, config


def _with_backend(runner, name: str, config):
    runner.attn = backend_class(name)(
        runner.pool, num_heads=config.num_heads, head_dim=config.head_dim, scale=config.attention_scale, max_batch=4
    )
    runner.attn.use_windows(config.kv_windows, config.attn_logit_softcapping)
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
        {"a": ids(9), "b": ids(1)},  # a chunk longer than a window of 8 over a prefix past it
    ]
    for step in steps:
        want = ref.step(step)
        have = got.step(step)
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)


def test_kv_stored_skips_the_backends_store(tiny, paged_runner):
    """With ``kv_stored=True`` the backend attends over what the caller wrote and writes
    nothing itself."""
    from engine.common.forward_batch import ForwardBatch

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


def test_auto_is_the_torch_backend_under_the_torch_kernels_switch():
    """``--kernels torch`` means the torch references everywhere: attention's ``auto``
    too, on CUDA with Triton installed."""
    from kernels.switches import using

    pytest.importorskip("triton")
    assert resolve_backend_name("auto", "cuda") == "triton"
    with using(kernels="torch"):
        assert resolve_backend_name("auto", "cuda") == "torch"
        assert resolve_backend_name("triton", "cuda") == "triton"  # asked for by name


def test_backends_declare_their_workspace():
    pytest.importorskip("triton")
    torch_ws = backend_class("torch").workspace_size(num_heads=16, num_kv_heads=8, head_dim=128, max_batch=64)
    triton_ws = backend_class("triton").workspace_size(num_heads=16, num_kv_heads=8, head_dim=128, max_batch=64)
    fi_ws = backend_class("flashinfer").workspace_size(num_heads=16, num_kv_heads=8, head_dim=128, max_batch=64)
    assert torch_ws == 0
    assert 0 < triton_ws < 64 << 20  # split-K partials: megabytes, not a pool's worth
    assert fi_ws == (128 + 2 * 8) << 20  # float workspace + two wrappers' integer workspaces


def test_fast_path_options_reach_the_engine_config(tmp_path):
    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

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
    # One sequence's prefill graphs: 512 tokens by default, 0 turns them off, no fewer.
    assert default.prefill_graph_tokens == 512
    off = resolve({}, env={"HEADROOM_PREFILL_GRAPH_TOKENS": "0"}, config_path=empty).engine_config()
    assert off.prefill_graph_tokens == 0
    with pytest.raises(SettingsError, match="--prefill-graph-tokens"):
        resolve({"prefill_graph_tokens": -1}, env={}, config_path=empty)


def test_prefill_graphs_skip_backends_that_plan_on_the_host():
    """FlashInfer's graphs need a plan made on the host before each replay
    (``graph_plan``), which the prefill graphs do not make: its prefill runs eagerly.
    Triton's need none; torch's backend is never captured (``supports_cuda_graphs``)."""
    from engine.core.prefill_graphs import backend_plans_on_host

    assert backend_plans_on_host(backend_class("flashinfer"))
    assert not backend_plans_on_host(backend_class("triton"))
    assert not backend_plans_on_host(backend_class("torch")) and not backend_class("torch").supports_cuda_graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_gathers_query_heads_as_repeating_kv_heads_would(dtype):
    """The torch backend's gather by query head (one index of pool rows per step) gives
    sdpa the tensors that gathering the KV heads and repeating them gave: the outputs of
    padded decode rows and of a chunk over a cached prefix equal that formulation's bit
    for bit."""
    import torch.nn.functional as F

    from engine.common.forward_batch import ForwardBatch
    from engine.kvcache.pool import KVPool

    hq, hk, d, ps = 6, 2, 16, 4
    pool = KVPool(num_layers=1, num_pages=16, page_size=ps, num_kv_heads=hk, head_dim=d, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g))
    attn = backend_class("torch")(pool, num_heads=hq, head_dim=d, scale=d**-0.5, max_batch=4)
    # Rows: decode (seq 9), decode (seq 5), a 3-token chunk over a 4-token prefix, decode (seq 7).
    seq, ext = [9, 5, 7, 7], [1, 1, 3, 1]
    pages = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 0], [8, 9, 0]])
    t = sum(ext)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    batch = ForwardBatch(
        is_decode=False, input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.zeros(t, dtype=torch.int64),
        out_slots=torch.zeros(t, dtype=torch.int64), page_table=pages, prefix_lens=torch.tensor([8, 4, 4, 6]),
        extend_lens=torch.tensor(ext), logits_indices=torch.tensor([0, 1, 4, 5]),
    )
    attn.prepare(batch)
    got = attn.forward(q, q[:, :hk], q[:, :hk], 0, batch, kv_stored=True).view(t, hq, d)

    def kv(b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # [H, length, D], heads repeated
        pos = torch.arange(length)
        slots = pages[b, pos // ps] * ps + pos % ps
        return tuple(buf[0].index_select(0, slots).transpose(0, 1).repeat_interleave(hq // hk, dim=0)
                     for buf in (pool.k_buffers, pool.v_buffers))

    decode = [0, 1, 3]
    longest = max(seq[b] for b in decode)
    ks, vs = zip(*(kv(b, longest) for b in decode), strict=True)  # padded past each row's length
    mask = (torch.arange(longest)[None, :] < torch.tensor([seq[b] for b in decode])[:, None])[:, None, None, :]
    rows = torch.tensor([0, 1, 5])
    want = F.scaled_dot_product_attention(q[rows][:, :, None], torch.stack(ks), torch.stack(vs), attn_mask=mask,
                                          scale=d**-0.5)[:, :, 0]
    assert torch.equal(got[rows], want)
    k2, v2 = kv(2, seq[2])
    chunk_mask = torch.arange(seq[2])[None, :] <= (4 + torch.arange(3))[:, None]
    want2 = F.scaled_dot_product_attention(q[2:5].transpose(0, 1)[None], k2[None], v2[None], attn_mask=chunk_mask,
                                           scale=d**-0.5)[0].transpose(0, 1)
    assert torch.equal(got[2:5], want2)
