"""gpt-oss against transformers' (eager attention) on a tiny random config whose window
(8 tokens) is shorter than the prompts (its logits and greedy ids, as every windowed
model's, in ``test_windowed_models.py``): the attention sinks, YaRN and the clamped SwiGLU each against
transformers' own functions; MXFP4 experts dequantized as transformers does; the
published 20B config and its plan; and the paths that decline it (the C decode layer,
the Triton MoE, the GPU attention backends, expert offload, tensor parallelism)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from model_checks import STEPS, VOCAB, check_attention_step, check_engine_greedy, pair_fixture

from engine.common.config import EngineConfig
from engine.common.load_errors import UnsupportedConfig
from engine.layers.cpu_decode import CpuDecode
from engine.loader.weight_size import weight_bytes

transformers = pytest.importorskip("transformers")

pair = pair_fixture(["gpt_oss"], VOCAB)


def test_config_follows_transformers(pair):
    _, hf, ours, config, _ = pair
    assert config.architecture == "GptOssForCausalLM"
    assert config.layer_types == tuple(hf.config.layer_types) == ("sliding_attention", "full_attention") * 2
    assert config.kv_windows == (8, 0, 8, 0) and config.windowed_attention
    assert config.attention_sinks and config.expert_bias and config.attention_bias
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 0.5)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_layers) == (8, 2, (0, 1, 2, 3))
    assert config.norm_topk_prob  # the top-k logits softmaxed alone
    rope = config.rope
    assert (rope.rope_type, rope.factor, rope.beta_fast, rope.beta_slow, rope.truncate) == ("yarn", 32.0, 32.0, 1.0, False)
    assert rope.original_max_position_embeddings == 16 and rope.theta == 150_000.0
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    held = sum(p.nbytes for p in ours.parameters()) + ours.cos_sin_cache.nbytes
    assert weight_bytes(config, torch.float32) == held


def test_yarn_cos_sin_equal_transformers(pair):
    """Our cos/sin cache (YaRN's frequencies, scaled by its attention factor) against the
    rotary embedding transformers' gpt-oss runs."""
    _, hf, ours, config, _ = pair
    positions = torch.arange(config.max_position_embeddings)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    half = config.head_dim // 2
    assert hf.model.rotary_emb.attention_scaling > 1  # the factor of 32 scales them
    # Angles reach 511 radians, whose float32 ulp is 3e-5: transformers' matmul of the
    # positions by the frequencies rounds them by a few ulp more or less with the CPU's
    # thread count, so 1e-6 failed now and then; a wrong YaRN factor moves them by far more.
    torch.testing.assert_close(ours.cos_sin_cache[:, :half], cos[0], rtol=0, atol=5e-4)
    torch.testing.assert_close(ours.cos_sin_cache[:, half:], sin[0], rtol=0, atol=5e-4)


def test_clamped_swiglu_experts_equal_transformers(pair):
    """One layer's mixture of experts (router with bias, top-2, experts' biases, the
    clamp at 0.5 reached) against transformers' ``GptOssMLP``."""
    _, hf, ours, _, _ = pair
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, _ = hf.model.layers[1].mlp(x[None])
        got = ours.model.layers[1].mlp(x)
        gate_up = x @ hf.model.layers[1].mlp.experts.gate_up_proj[0]
    assert bool((gate_up.abs() > 0.5).any())  # the clamp bites on these weights
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_sinks_and_window_equal_eager_attention(backend):
    """The backend's sinks, in a layer of window 5 and a global one, against transformers'
    gpt-oss eager attention (Triton's kernels under its interpreter)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.randn(4, generator=torch.Generator().manual_seed(7)) * 2

    def eager(q, k, v, mask, scale):
        return eager_attention_forward(module, q, k, v, mask, scaling=scale)[0]

    check_attention_step((5, 0), eager, sinks=module.sinks, backend=backend)


def test_sinks_get_triton_on_cuda_and_flashinfer_refuses_them():
    """auto picks Triton on CUDA (torch on the CPU) for a model with sinks; FlashInfer asked
    for by name is refused, and a backend without sinks refuses them in a call."""
    pytest.importorskip("triton")
    from engine.layers.attention.registry import backend_class, resolve_backend_name

    assert resolve_backend_name("auto", "cuda", windows=True, sinks=True) == "triton"
    assert resolve_backend_name("auto", "cpu", windows=True, sinks=True) == "torch"
    assert resolve_backend_name("triton", "cuda", windows=True, sinks=True) == "triton"
    with pytest.raises(ValueError, match="--attention-backend flashinfer has no sliding-window or sink attention"):
        resolve_backend_name("flashinfer", "cuda", windows=True, sinks=True)
    sinkless = backend_class("flashinfer").__new__(backend_class("flashinfer"))  # no CUDA needed to ask
    sinkless.pool = None
    with pytest.raises(ValueError, match="no attention sinks; use --attention-backend torch"):
        sinkless.forward(torch.zeros(1, 4, 8), None, None, 0, None, kv_stored=True, sinks=torch.zeros(4))


def test_kernel_paths_take_or_decline_gpt_oss(pair, dev):
    """The Triton MoE takes its experts (biases and clamped SwiGLU in the epilogues: the
    reference's output within float32 order); the C decode layer declines it; expert
    offload and tensor parallelism refuse it."""
    from engine.layers.moe.offload import offload_experts
    from kernels.moe import reference
    from kernels.moe.reference import ExpertBiases

    _, _, ours, config, _ = pair
    assert CpuDecode.build(ours, lib=None) is None
    triton_moe = pytest.importorskip("kernels.moe.triton_kernel")
    experts = ours.model.layers[0].mlp.experts
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    weights, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [1, 7]])
    with torch.no_grad():
        b = experts.biases
        got = triton_moe.fused_moe(*(t.to(dev) for t in (x, experts.gate_up_proj, experts.down_proj, weights, ids)),
                                   biases=ExpertBiases(b.gate_up.to(dev), b.down.to(dev)),
                                   activation=experts.activation).cpu()
        want = reference.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                                   biases=experts.biases, activation=experts.activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be offloaded yet"):
        offload_experts(ours, (0,), 4)
    with pytest.raises(ValueError, match="tensor-parallel"):
        ours.use_parallel(None, VOCAB)


def test_decode_is_captured_with_its_experts(pair):
    """On CUDA with the Triton attention, a gpt-oss engine's decode takes the CUDA graphs,
    as the same model without biases and clamp does (its experts are the Triton MoE's)."""
    from dataclasses import replace

    from engine.core.plan_stages import PlanStages
    from engine.memory.plan import PlanKnobs

    config = pair[3]
    stages = PlanStages.__new__(PlanStages)
    stages.config, stages.device, stages.tp, stages.expert_stores = EngineConfig(), torch.device("cuda"), None, {}
    stages.attention_backend, stages.cpu_layers = "triton", 0
    stages.knobs = PlanKnobs.of(stages.config)
    stages.model_config = replace(config, expert_bias=False, swiglu_limit=0.0)
    assert stages._use_cuda_graphs
    stages.model_config = config
    assert stages._use_cuda_graphs


# The fields of openai/gpt-oss-20b's config.json (its experts in MXFP4).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_gpt_oss_20b_config_reads_as_published(tmp_path):
    """The 20B's config as published (its experts in MXFP4) reads as the model it is; a
    quantization other than MXFP4 is refused."""
    import json

    from engine.layers.rope import attention_factor
    from engine.loader.hf_config import load_model_config

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    mc = load_model_config(tmp_path)
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (24, 64, 8, 64, 201088)
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size) == (32, 4, 2880)
    assert mc.kv_windows == (128, 0) * 12 and mc.attention_sinks and (mc.swiglu_alpha, mc.swiglu_limit) == (1.702, 7.0)
    assert (mc.rope.rope_type, mc.rope.factor, mc.rope.original_max_position_embeddings) == ("yarn", 32.0, 4096)
    assert not mc.rope.truncate and attention_factor(mc.rope) == pytest.approx(0.1 * math.log(32) + 1)
    assert mc.eos_token_ids == (200002,) and not mc.tie_word_embeddings
    (tmp_path / "config.json").write_text(json.dumps({**GPT_OSS_20B, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UnsupportedConfig, match="gpt-oss with awq weights is not supported"):
        load_model_config(tmp_path)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, R, K]`` to MXFP4 as OpenAI's checkpoints store it: codes ``[E, R, K / 32, 16]``
    (two a byte, low nibble first) and scales ``[E, R, K / 32]`` (the power of two biased
    by 127), each block's largest value mapped near 6."""
    e, r, k = w.shape
    x = w.reshape(e, r, k // 32, 32)
    exponent = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-12) / 6.0))
    codes = (x / torch.exp2(exponent)[..., None])[..., None].sub(E2M1).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_load_dequantized_as_transformers_dequantizes_them(tmp_path, make_tiny_hf_model, caplog):
    """A checkpoint whose experts are MXFP4 blocks (``quantization_config`` mxfp4, the
    tensors ``*_blocks``/``*_scales``) keeps them in GGML's MXFP4 blocks, which
    dequantize to transformers' dequantization of the same blocks, and decodes as that
    model does; a model built with dense experts gets them dequantized at load."""
    import json
    from dataclasses import replace

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.layers.moe.quant_experts import QuantExperts
    from engine.loader.hf_config import load_model_config
    from engine.loader.load import load_model
    from engine.loader.meta_build import build_on_meta, materialize
    from engine.loader.weights import iter_weights
    from kernels.quant.reference import dequantize

    hf = make_tiny_hf_model("gpt_oss", None, vocab_size=VOCAB)
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                blocks, scales = to_mxfp4(getattr(experts, proj).transpose(1, 2))
                tensors[prefix + proj + "_blocks"], tensors[prefix + proj + "_scales"] = blocks, scales
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    tensors.update({k: v for k, v in hf.state_dict().items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, config = load_model(tmp_path, "cpu", torch.float32)
    want = hf.model.layers[2].mlp.experts.gate_up_proj[3].T  # [2I, H], gate and up rows interleaved
    experts = ours.model.layers[2].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.types == ("MXFP4",) * 3
    got = torch.cat([dequantize(b[3], "MXFP4", config.hidden_size) for b in (experts.gate, experts.up)])
    assert torch.equal(got, torch.cat((want[0::2], want[1::2])))
    check_engine_greedy(hf, tmp_path, VOCAB, STEPS, 20)
    dense = build_on_meta(replace(load_model_config(tmp_path), expert_block_type=""), torch.float32)
    materialize(dense, "cpu")
    with caplog.at_level(logging.INFO, logger="headroom.engine"):
        dense.load_weights(iter_weights(tmp_path))
    assert "MXFP4 blocks are dequantized to float32 at load" in caplog.text
    assert torch.equal(dense.model.layers[2].mlp.experts.gate_up_proj[3], got)


def test_an_mxfp4_pair_that_does_not_go_together_is_refused_naming_both():
    """A damaged checkpoint (scales cut short) is a load error naming both tensors and the
    fix, not a bare ValueError from the repacking."""
    from engine.common.load_errors import WeightMismatch
    from engine.models.gpt_oss import _dequantized

    base = "model.layers.1.mlp.experts.gate_up_proj"
    weights = [(base + "_blocks", torch.zeros(8, 64, 2, 16, dtype=torch.uint8)),
               (base + "_scales", torch.zeros(8, 64, 1, dtype=torch.uint8))]
    with pytest.raises(WeightMismatch, match=f"{base}_blocks uint8 \\(8, 64, 2, 16\\) and {base}_scales uint8 "
                       "\\(8, 64, 1\\) are not an MXFP4 pair.*download them again"):
        list(_dequantized(weights, torch.float32, {}))


def test_plan_keeps_the_experts_on_the_device(tmp_path):
    """gpt-oss-20b (its experts kept in MXFP4 blocks) on a simulated 12 GiB card: its experts
    cannot move to host memory, so the plan keeps them all on the device, priced at 17
    bytes a block of 32 weights, and suggests no --cpu-experts; asking for host layers is
    refused before anything loads."""
    import json

    from engine.common.errors import SettingRefused
    from engine.core.footprint import make_footprint
    from engine.core.settings_fit import check_for_model
    from engine.loader.hf_config import load_model_config
    from engine.memory.device import simulated_device
    from engine.memory.ledger import make_plan
    from engine.memory.plan import GiB, PlanKnobs

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    mc = load_model_config(tmp_path)
    assert mc.is_moe and not mc.experts_offload
    knobs = PlanKnobs(max_running_requests=4)
    plan = make_plan(simulated_device(12 * GiB), knobs, make_footprint(mc, torch.bfloat16, knobs))
    experts = {e.name: e for e in plan.ledger}["routed expert weights"]
    assert experts.bytes == 24 * 32 * 3 * 2880 * 2880 // 32 * 17 + 24 * 32 * (2 * 2880 + 2880) * 2  # blocks, biases
    assert "all on the device" in experts.source and plan.cpu_expert_layers == 0
    assert not plan.fits and "--cpu-experts" not in [s.flag for s in plan.suggestions]
    with pytest.raises(SettingRefused, match="--cpu-experts 2: GptOssForCausalLM's experts .* stay on the device"):
        check_for_model(EngineConfig(model=str(tmp_path), cpu_experts="2"), mc)
