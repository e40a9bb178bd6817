"""Qwen3.5 / Qwen3.6 GGUF files as llama.cpp writes them (``qwen35``, ``qwen35moe``:
``convert_hf_to_gguf.py``'s names, ``1 + w`` norms, ``-exp(A_log)``, the conv kernel
squeezed, value heads reordered from grouped to tiled, a multi-token-prediction block
after the model's; Q8_0 matrices), written here from tiny random transformers models:
the conversion reads the config back, the projections kept in their blocks give
transformers' logits, and the engine on the GGUF answers transformers' greedy ids,
dequantized or in blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_checks import check_extend_and_decode, hf_greedy
from test_engine import run_all
from test_gguf_convert import VOCAB, add_byte_level_tokenizer, add_moe_metadata, add_trunk_metadata
from tiny_hf_parts import tiny_qwen36_config

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.layers.linear.gguf_blocks import QuantLinear
from engine.loader.gguf_quant import load_gguf_quantized
from engine.loader.hf_config import load_model_config
from engine.loader.resolve import resolve_model
from engine.wire.messages import SamplingParams

gguf = pytest.importorskip("gguf")

STEPS = 12

# transformers' names -> llama.cpp's (gguf-py's tensor map for QWEN35 / QWEN35MOE).
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _tiled(w: np.ndarray, dim: int, hk: int, per: int, head: int) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: value heads grouped by key head -> tiled."""
    shape = list(w.shape)
    grouped = w.reshape(*shape[:dim], hk, per, head, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(grouped, dim, dim + 1)).reshape(shape)


def _linear_tensor(rest: str, w: np.ndarray, cfg) -> np.ndarray:
    """A linear-attention tensor as llama.cpp stores it."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    per, qk = hv // hk, 2 * hk * dk
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        w = w.reshape(w.shape[0], -1) if rest.endswith("conv1d.weight") else w
        return np.concatenate([w[:qk], _tiled(w[qk:], 0, hk, per, dv)])
    if rest == "linear_attn.in_proj_z.weight":
        return _tiled(w, 0, hk, per, dv)
    if rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
        return _tiled(w, 0, hk, per, 1)
    if rest == "linear_attn.A_log":
        return -np.exp(_tiled(w, 0, hk, per, 1))
    if rest == "linear_attn.out_proj.weight":
        return _tiled(w, 1, hk, per, dv)
    return w


def _gguf_tensors(name: str, w: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """GGUF names and arrays of one transformers tensor, transformed as llama.cpp does;
    zero-centred norms (not the linear layers' gated one) stored as ``1 + w``."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP:
        w = w + 1.0 if stem == "model.norm" else w
        return [(f"{_TOP[stem]}.{suffix}", w)]
    _, _, layer, rest = name.split(".", 3)
    if rest.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
        w = w + 1.0
    if rest.startswith("linear_attn."):
        w = _linear_tensor(rest, w, cfg)
    if rest == "linear_attn.A_log":
        return [(f"blk.{layer}.ssm_a", w)]
    if rest == "linear_attn.dt_bias":
        return [(f"blk.{layer}.ssm_dt.bias", w)]
    if rest == "mlp.experts.gate_up_proj":
        if layer == "0":  # llama.cpp's fused layout, as it may write it
            return [(f"blk.{layer}.ffn_gate_up_exps.weight", w)]
        half = w.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half]), (f"blk.{layer}.ffn_up_exps.weight", w[:, half:])]
    if rest == "mlp.experts.down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", w)]
    module, _, suffix = rest.rpartition(".")
    return [(f"blk.{layer}.{_LAYER[module]}.{suffix}", w)]


def write_qwen35_gguf(path, hf) -> str:
    """``hf`` (a tiny ``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM``) as llama.cpp's
    ``qwen35`` / ``qwen35moe`` GGUF, with a multi-token-prediction block after the
    model's (as llama.cpp writes it unless told not to, here with a few placeholder
    tensors); returns the architecture. Matrices whose rows are whole Q8_0 blocks are
    stored Q8_0 and ``hf`` is updated to their dequantized values (the reorders move
    whole rows or whole blocks, so both sides hold the same numbers); the rest float32."""
    cfg = hf.config
    moe = bool(getattr(cfg, "num_experts", 0))
    arch = "qwen35moe" if moe else "qwen35"
    w = gguf.GGUFWriter(str(path), arch)
    add_trunk_metadata(w, cfg, extra_blocks=1)  # llama.cpp's multi-token-prediction layer
    w.add_nextn_predict_layers(1)
    if not moe:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    w.add_rope_dimension_count(int(cfg.head_dim * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(2)
    add_moe_metadata(w, cfg)
    add_byte_level_tokenizer(w)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim >= 2 and param.shape[-1] % 32 == 0:
                blocks = gguf.quantize(param.numpy(), q8)
                param.copy_(torch.from_numpy(gguf.dequantize(blocks, q8).reshape(param.shape)))
    for name, tensor in hf.state_dict().items():
        for gname, part in _gguf_tensors(name, tensor.detach().float().numpy(), cfg):
            part = np.ascontiguousarray(part, dtype=np.float32)
            if part.ndim >= 2 and part.shape[-1] % 32 == 0:
                w.add_tensor(gname, gguf.quantize(part, q8), raw_dtype=q8)
            else:
                w.add_tensor(gname, part)
    mtp, h = cfg.num_hidden_layers, cfg.hidden_size
    for stem, shape in (("nextn.eh_proj", (h, 2 * h)), ("nextn.enorm", (h,)), ("attn_norm", (h,))):
        w.add_tensor(f"blk.{mtp}.{stem}.weight", np.ones(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arch


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def written(request, tmp_path_factory, make_tiny_hf_model):
    hf = make_tiny_hf_model(request.param, None, vocab_size=VOCAB)
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / f"tiny-{request.param}.gguf"
    arch = write_qwen35_gguf(path, hf)
    return hf, path, arch, folder


def test_the_config_reads_back(written, monkeypatch):
    hf, path, arch, folder = written
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(folder / "cache"))
    mc = load_model_config(resolve_model(str(path)))
    cfg = hf.config
    assert mc.architecture == type(hf).__name__ and mc.is_hybrid
    assert mc.num_layers == cfg.num_hidden_layers  # the prediction block is not the model's
    assert mc.layer_types == tuple(cfg.layer_types) and mc.rotary_dim == 8
    assert (mc.linear_num_key_heads, mc.linear_num_value_heads) == (2, 4)
    assert (mc.linear_key_head_dim, mc.linear_value_head_dim, mc.linear_conv_kernel_dim) == (16, 32, 4)
    if arch == "qwen35moe":
        assert mc.moe_layers == (0, 1, 2, 3) and mc.norm_topk_prob and mc.shared_expert_intermediate_size == 48
    else:
        assert mc.intermediate_size == cfg.intermediate_size and not mc.is_moe


def test_blocks_kept_as_on_cuda_give_transformers_logits(written, monkeypatch, paged_runner):
    """The CUDA layout (projections and routed experts in their Q8_0 blocks, value heads
    reordered on the blocks' rows, ssm_out's input tiled), run by the torch reference."""
    hf, path, _, folder = written
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(folder / "cache"))
    mc = load_model_config(resolve_model(str(path)))
    model = load_gguf_quantized(mc, path, "cpu", torch.float32, experts_in_blocks=True)
    assert isinstance(model.model.layers[0].linear_attn.in_proj_qkvz, QuantLinear)
    assert model.model.layers[0].linear_attn.out_proj_tiled
    check_extend_and_decode(hf, paged_runner(model, mc), VOCAB)


@pytest.mark.parametrize("blocks", [None, False], ids=["cpu-blocks", "dequantized"])
def test_greedy_ids_from_the_gguf_equal_transformers(written, monkeypatch, blocks):
    """The CPU's default load (projections in blocks, for its kernels) and the
    dequantized one."""
    hf, path, _, folder = written
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(folder / "cache"))
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64, max_prefill_tokens=16,
                                 gguf_quantized=blocks))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 40)]
    sp = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    ours = run_all(engine, {str(i): (ids, sp) for i, ids in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        assert ours[str(i)] == hf_greedy(hf, ids, STEPS)


def test_the_random_qwen36_gguf_converts_and_loads_in_blocks(tmp_path, paged_runner):
    """The random ``qwen35moe`` file the GPU runs serve (K-quant blocks built directly,
    the default model's tokenizer), at a small Qwen3.6-35B-A3B-like shape: it converts,
    its projections and experts load in their blocks, priced exactly, and a step gives
    finite logits."""
    from engine.bench.random_gguf import MOE_EXPERT_TYPES, write_random_moe_gguf
    from engine.layers.weight_census import model_weight_bytes
    from engine.loader.gguf_convert import convert_gguf
    from engine.loader.gguf_quant import gguf_weight_size

    shape = tiny_qwen36_config(tmp_path / "cfg")
    path = tmp_path / "qwen36.gguf"
    write_random_moe_gguf(path, shape, np.random.default_rng(0))
    config = load_model_config(convert_gguf(path, tmp_path / "hf"))
    assert (config.architecture, config.layer_types, config.moe_layers) == (
        "Qwen3_5MoeForCausalLM", shape.layer_types, (0, 1, 2, 3))
    model = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    assert all(layer.mlp.experts.types == MOE_EXPERT_TYPES for layer in model.model.layers)
    assert isinstance(model.model.layers[0].linear_attn.out_proj, QuantLinear)
    size = gguf_weight_size(path, config, torch.float32)
    assert size.bytes == model_weight_bytes(model)  # the RoPE cache (rotary_dim wide) counted on both sides
    logits = paged_runner(model, config).step({0: [1, 2, 3]})
    assert logits.shape == (1, config.vocab_size) and bool(torch.isfinite(logits).all())


def test_the_tokenizer_is_built_the_same_through_its_stand_in(tmp_path):
    """A qwen35moe file's tokenizer, read from a tokenizer-only copy under qwen3moe (as
    transformers releases that refuse qwen35moe need): the same ids, special tokens and
    chat template as this transformers builds from the file itself."""
    from transformers import AutoTokenizer

    from engine.bench.random_gguf import write_random_moe_gguf
    from engine.loader.gguf_tokenizer import build_tokenizer

    shape = tiny_qwen36_config(tmp_path / "cfg")
    write_random_moe_gguf(tmp_path / "q.gguf", shape, np.random.default_rng(0))
    native = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="q.gguf", local_files_only=True)
    stand_in = build_tokenizer(tmp_path / "q.gguf", "qwen35moe")
    text = "Hello, world! Ünïcödé 123 <|im_start|>user\n  tabs\tand  spaces"
    assert stand_in(text).input_ids == native(text).input_ids
    assert (stand_in.eos_token, stand_in.bos_token, len(stand_in)) == (native.eos_token, native.bos_token, len(native))
    assert stand_in.chat_template == native.chat_template
