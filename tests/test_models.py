"""Our decoder against transformers' on tiny random models of each architecture,
plus the kernels and RoPE cache against their transformers counterparts."""

from __future__ import annotations

import pytest
import torch
from model_checks import assert_close, check_extend_and_decode, check_ragged_batch, hf_logits

from engine.common.config import RopeConfig
from engine.common.load_errors import UnsupportedArchitecture, UnsupportedConfig
from engine.layers.rope import build_cos_sin_cache
from engine.loader.load import load_model
from engine.loader.weight_size import weight_bytes
from engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class
from kernels.activation.reference import silu_and_mul
from kernels.norm.reference import rms_norm
from kernels.rotary.reference import apply_rotary

transformers = pytest.importorskip("transformers")

VOCAB = 256


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory, make_tiny_hf_model):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_hf_model(request.param, path, vocab_size=VOCAB)
    ours, config = load_model(path, "cpu", torch.float32)
    return request.param, hf, ours, config


def test_config_reflects_architecture(pair):
    kind, _, _, config = pair
    assert config.attention_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    assert config.tie_word_embeddings == (kind == "qwen3")
    assert config.head_dim == (32 if kind == "qwen3" else 16)
    if kind == "llama":
        assert config.rope.rope_type == "llama3"
        assert config.rope.original_max_position_embeddings == 32


def test_prefill_matches_transformers(pair, paged_runner):
    _, hf, ours, config = pair
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = paged_runner(ours, config).step({0: ids})
    assert logits.shape == (1, VOCAB) and logits.dtype == torch.float32
    assert_close(logits[0], hf_logits(hf, ids)[-1])


def test_chunked_prefill_and_decode_match_transformers(pair, paged_runner):
    _, hf, ours, config = pair
    check_extend_and_decode(hf, paged_runner(ours, config), VOCAB)


def test_ragged_batch_matches_transformers(pair, paged_runner):
    _, hf, ours, config = pair
    check_ragged_batch(hf, paged_runner(ours, config), VOCAB)


def test_weight_bytes_is_exact(pair):
    _, _, ours, config = pair
    held = sum(p.nbytes for p in ours.parameters()) + ours.cos_sin_cache.nbytes
    assert weight_bytes(config, torch.float32) == held
    params = sum(p.numel() for p in ours.parameters())
    assert weight_bytes(config, torch.bfloat16) == 2 * params + ours.cos_sin_cache.nbytes


def test_bfloat16_load_keeps_rope_cache_float32(tmp_path, paged_runner, make_tiny_hf_model):
    hf = make_tiny_hf_model("qwen3", tmp_path, vocab_size=VOCAB)
    ours, config = load_model(tmp_path, "cpu", torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.cos_sin_cache.dtype == torch.float32
    ids = list(range(10))
    logits = paged_runner(ours, config).step({0: ids})[0]
    ref = hf_logits(hf, ids)[-1]
    assert logits.dtype == torch.float32
    assert float((logits - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_registry_covers_supported_architectures():
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch) is not None
    with pytest.raises(UnsupportedArchitecture) as e:
        get_model_class("GPT2LMHeadModel")
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


# -- kernels and RoPE against transformers ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bitwise(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(5, 64).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
        assert torch.equal(rms_norm(x, ref.weight, 1e-6), ref(x))


@pytest.mark.parametrize(
    "rope",
    [
        RopeConfig(theta=10000.0),
        RopeConfig(theta=500000.0, rope_type="linear", factor=2.0),
        RopeConfig(
            theta=500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ],
    ids=lambda r: r.rope_type,
)
def test_rope_cache_matches_transformers_bitwise(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type != "default":
        params["factor"] = rope.factor
    if rope.rope_type == "llama3":
        params.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, rope_parameters=params
    )
    positions = torch.arange(512)
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[None])
    cache = build_cos_sin_cache(rope, 128, 512)
    assert torch.equal(cache[:, :64], cos[0, :, :64])
    assert torch.equal(cache[:, 64:], sin[0, :, :64])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_yarn_rope_matches_transformers(kind, tmp_path, paged_runner, make_tiny_hf_model):
    """YaRN (as Qwen3's long-context configs set it; ramp ends truncated, the attention
    factor derived from ``factor``) in the Llama layout, through prefill, extend and decode."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    hf = make_tiny_hf_model(kind, tmp_path, vocab_size=VOCAB, rope_scaling=rope, rope_parameters=rope)
    model, config = load_model(tmp_path, "cpu", torch.float32)
    assert (config.rope.rope_type, config.rope.factor, config.rope.truncate) == ("yarn", 4.0, True)
    check_extend_and_decode(hf, paged_runner(model, config), VOCAB)


def test_unknown_rope_type_is_refused():
    with pytest.raises(UnsupportedConfig, match="longrope"):
        build_cos_sin_cache(RopeConfig(rope_type="longrope"), 64, 8)


def test_apply_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cache = build_cos_sin_cache(RopeConfig(), 32, 64)
    positions = torch.tensor([0, 5, 17, 63])
    q, k = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    cos = torch.cat([cache[positions, :16]] * 2, dim=-1)
    sin = torch.cat([cache[positions, 16:]] * 2, dim=-1)
    # transformers wants [B, H, T, D] with cos/sin [B, T, D].
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    out_q, out_k = apply_rotary(q, k, positions, cache)
    assert torch.equal(out_q, ref_q[0].transpose(0, 1))
    assert torch.equal(out_k, ref_k[0].transpose(0, 1))


def test_silu_and_mul():
    x = torch.randn(3, 8)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
