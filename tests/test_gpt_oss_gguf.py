"""A tiny random gpt-oss written as llama.cpp's converter writes a ``gpt-oss`` GGUF (gguf-py's
tensor names, the experts' gate and up split apart and transposed, the sinks as
``attn_sinks.weight``, window, expert counts and YaRN in the metadata; experts in F16,
or in MXFP4 blocks) loads as the same model: the conversion's tensors are the Hugging Face
checkpoint's, and the engine's greedy ids over the file equal those over the safetensors
folder and transformers'. OpenAI's MXFP4 blocks as llama.cpp repacks them read as
transformers dequantizes them; an expert half without its pair is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_checks import hf_greedy

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_engine import run_all  # noqa: E402
from test_gguf_convert import VOCAB, add_byte_level_tokenizer, add_trunk_metadata  # noqa: E402

from engine.common.config import EngineConfig  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.loader.gguf_convert import ensure_gguf_weights  # noqa: E402
from engine.loader.hf_config import load_model_config  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402
from engine.loader.weights import iter_weights  # noqa: E402
from engine.wire.messages import SamplingParams  # noqa: E402

STEPS = 14
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
F16, MXFP4 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.MXFP4


def stored(w: torch.Tensor, kind) -> tuple[np.ndarray, torch.Tensor]:
    """``w`` ``[E, R, C]`` as the GGUF stores it in ``kind`` (F16 values or MXFP4 blocks),
    and the values the file holds."""
    x = w.detach().numpy().astype(np.float32)
    if kind == F16:
        data = x.astype(np.float16)
        return data, torch.from_numpy(data.astype(np.float32))
    data = gguf.quantize(x, kind)
    return data, torch.from_numpy(gguf.dequantize(data, kind).reshape(x.shape))


def write_gpt_oss_gguf(path, hf, experts_kind) -> None:
    """``hf`` as llama.cpp's ``gpt-oss`` GGUF: names by gguf-py's map, 1-D tensors and
    attention in F32, the experts in ``experts_kind``; ``hf``'s experts are updated to the
    values the file holds, so both sides hold the same numbers."""
    cfg = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    add_trunk_metadata(writer, cfg)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    add_byte_level_tokenizer(writer)

    def add(hf_name: str, data) -> None:
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data,
                          raw_dtype=experts_kind if data.dtype == np.uint8 else None)

    with torch.no_grad():
        for name, param in hf.named_parameters():
            prefix = name.rpartition(".")[0]
            if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] interleaved -> gate, up [E, I, H]
                for half, proj in ((0, "gate_proj"), (1, "up_proj")):
                    data, held = stored(param[:, :, half::2].transpose(1, 2), experts_kind)
                    param[:, :, half::2] = held.transpose(1, 2)
                    add(f"{prefix}.{proj}.weight", data)
            elif name.endswith("experts.gate_up_proj_bias"):
                add(f"{prefix}.gate_proj.bias", param[:, 0::2].numpy().copy())
                add(f"{prefix}.up_proj.bias", param[:, 1::2].numpy().copy())
            elif name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
                data, held = stored(param.transpose(1, 2), experts_kind)
                param.copy_(held.transpose(1, 2))
                add(f"{prefix}.down_proj.weight", data)
            elif name.endswith("experts.down_proj_bias"):
                add(f"{prefix}.down_proj.bias", param.numpy().copy())
            elif name.endswith("self_attn.sinks"):
                add(f"{name}.weight", param.numpy().copy())
            else:
                add(name, param.numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[F16, MXFP4], ids=["f16", "mxfp4"])
def gpt_oss_gguf(request, tmp_path_factory, make_tiny_hf_model):
    """(transformers' model holding the file's values, its safetensors folder, the GGUF,
    the GGUF's conversion) under a cache folder of the module's own. The clamp is
    llama.cpp's fixed 7.0: the file cannot carry another."""
    tmp = tmp_path_factory.mktemp(f"gpt-oss-gguf-{request.param.name}")
    hf = make_tiny_hf_model("gpt_oss", None, vocab_size=VOCAB, swiglu_limit=7.0)
    write_gpt_oss_gguf(tmp / "tiny-gpt-oss.gguf", hf, request.param)
    hf.save_pretrained(tmp / "safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADROOM_CACHE_DIR", str(tmp / "cache"))
        yield hf, tmp / "safetensors", tmp / "tiny-gpt-oss.gguf", resolve_model(str(tmp / "tiny-gpt-oss.gguf"))


def test_gguf_config_and_tensors_are_the_checkpoints(gpt_oss_gguf):
    """The conversion's config reads as the safetensors model's, and its tensors are the
    checkpoint's exactly: names, gate and up interleaved back, transposes undone."""
    hf, safetensors, _, folder = gpt_oss_gguf
    ours, want = load_model_config(folder), load_model_config(safetensors)
    assert ours.architecture == "GptOssForCausalLM" and ours.layer_types == want.layer_types
    assert ours.kv_windows == (8, 0, 8, 0) and ours.attention_sinks and ours.expert_bias
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (8, 2, 32)
    assert (ours.swiglu_alpha, ours.swiglu_limit) == (want.swiglu_alpha, want.swiglu_limit) == (1.702, 7.0)
    assert ours.rope == want.rope and ours.rope.rope_type == "yarn" and not ours.rope.truncate
    assert not ours.tie_word_embeddings
    ensure_gguf_weights(folder)
    got = dict(iter_weights(folder))
    state = hf.state_dict()
    assert sorted(got) == sorted(state)
    for name, w in state.items():
        assert torch.equal(got[name], w), name


def test_gguf_greedy_equals_safetensors_and_transformers(gpt_oss_gguf):
    """14 greedy ids over the GGUF (the CPU's default: MXFP4 experts kept in their blocks,
    F16 ones dequantized) equal those over the safetensors folder and transformers'."""
    hf, safetensors, gguf_path, _ = gpt_oss_gguf
    ids = torch.randint(3, VOCAB, (22,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_greedy(hf, ids, STEPS)

    def greedy(model: str) -> list[int]:
        engine = Engine(EngineConfig(model=model, device="cpu", page_size=4, num_pages=64))
        return run_all(engine, {"g": (ids, GREEDY)})["g"]

    assert greedy(str(safetensors)) == want
    assert greedy(str(gguf_path)) == want


def test_openai_mxfp4_blocks_repacked_as_llama_cpp_does_read_as_transformers_dequantizes_them():
    """OpenAI's MXFP4 blocks (two codes a byte, the even element low; a scale a block of 32)
    moved bit for bit into GGML's ``block_mxfp4`` (the scale byte, then byte j holding
    element j low and j + 16 high) by the loader's repacking (``mxfp4_to_ggml``), as
    llama.cpp's converter writes gpt-oss's experts, read through gguf-py as transformers'
    dequantization reads the originals."""
    from test_gpt_oss import to_mxfp4
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.models.gpt_oss import mxfp4_to_ggml

    w = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(2))
    blocks, scales = to_mxfp4(w)  # [E, R, G, 16], [E, R, G]
    got = gguf.dequantize(mxfp4_to_ggml(blocks, scales).numpy(), MXFP4).reshape(w.shape)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G * 32, R]: transposed
    assert torch.equal(torch.from_numpy(got), want.transpose(1, 2))


def test_an_expert_half_without_its_pair_is_refused():
    """A gate expert tensor whose up half never comes names the layer."""
    from engine.common.load_errors import ModelLoadError
    from engine.loader.gguf_gpt_oss import checkpoint_tensors

    tensors = [("blk.0.ffn_gate_exps.weight", torch.zeros(2, 4, 8)), ("blk.0.attn_sinks.weight", torch.zeros(4))]
    with pytest.raises(ModelLoadError, match="gate or up half missing: blk.0.ffn_gate_exps/ffn_up_exps.weight"):
        list(checkpoint_tensors(tensors))
    with pytest.raises(ModelLoadError, match="blk.0.ffn_norm.weight has no counterpart in a gpt-oss checkpoint"):
        list(checkpoint_tensors([("blk.0.ffn_norm.weight", torch.zeros(4))]))
