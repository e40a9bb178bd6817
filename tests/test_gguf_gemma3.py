"""A tiny random Gemma 3 written as llama.cpp writes a ``gemma3`` GGUF (its tensor names,
norms stored as ``1 + w``, five sliding layers to one global, window and RoPE in the
metadata) loads as the same model: logits equal transformers', and the engine's greedy
ids over the file equal those over the safetensors folder, dequantized or in blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_checks import agreeing_prefix, hf_greedy, hf_logits

gguf = pytest.importorskip("gguf")

from test_engine import run_all  # noqa: E402
from test_gguf_convert import VOCAB, add_byte_level_tokenizer, add_trunk_metadata  # noqa: E402

from engine.common.config import EngineConfig  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.loader.load import load_model  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402
from engine.wire.messages import SamplingParams  # noqa: E402

LOCAL, GLOBAL = "sliding_attention", "full_attention"
# llama.cpp's layer names for Gemma 3 (gguf-py's MODEL_TENSORS[MODEL_ARCH.GEMMA3]).
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
STEPS = 14
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


def write_gemma3_gguf(path, hf) -> None:
    """``hf`` as a ``gemma3`` GGUF: matrices Q8_0, norms F32 as ``1 + w``; ``hf`` is updated
    to the values the file holds, so both sides hold the same numbers."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    add_trunk_metadata(writer, cfg, rope_theta=cfg.rope_parameters[GLOBAL]["rope_theta"])
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(cfg.rope_parameters[GLOBAL]["factor"])
    writer.add_sliding_window(cfg.sliding_window)
    add_byte_level_tokenizer(writer)
    with torch.no_grad():
        for name, param in hf.named_parameters():  # a tied head once, as the embeddings
            w = param.detach().numpy().astype(np.float32)
            if w.ndim == 2:
                q = gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)))
                writer.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:  # a norm: stored as the 1 + w it scales by
                stored = w + np.float32(1.0)
                param.copy_(torch.from_numpy(stored) - 1.0)
                writer.add_tensor(gguf_name(name), stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory, make_tiny_hf_model):
    """(transformers' model holding the file's values, its safetensors folder, the GGUF's
    conversion), under a cache folder of the module's own."""
    tmp = tmp_path_factory.mktemp("gemma3-gguf")
    # llama.cpp's layout: five local layers to one global, the scale from head_dim.
    hf = make_tiny_hf_model("gemma3", None, vocab_size=VOCAB, layer_types=[LOCAL] * 5 + [GLOBAL],
                            query_pre_attn_scalar=16)
    write_gemma3_gguf(tmp / "tiny-gemma3.gguf", hf)
    hf.save_pretrained(tmp / "safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADROOM_CACHE_DIR", str(tmp / "cache"))
        yield hf, tmp / "safetensors", tmp / "tiny-gemma3.gguf", resolve_model(str(tmp / "tiny-gemma3.gguf"))


def test_gguf_config_is_the_models(gemma3_gguf, paged_runner):
    hf, _, _, folder = gemma3_gguf
    model, config = load_model(folder, "cpu", torch.float32)
    assert config.architecture == "Gemma3ForCausalLM" and config.layer_types == tuple(hf.config.layer_types)
    assert config.kv_windows == (8, 8, 8, 8, 8, 0) and config.attention_scale == 16**-0.5
    assert (config.rope.rope_type, config.rope.factor, config.rope_local.theta) == ("linear", 8.0, 10_000.0)
    assert config.tie_word_embeddings
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = paged_runner(model, config).step({0: ids})[0]
    ref = hf_logits(hf, ids)[-1]
    assert float((logits - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_gguf_greedy_equals_safetensors_and_transformers(gemma3_gguf):
    hf, safetensors, gguf_path, _ = gemma3_gguf
    ids = torch.randint(3, VOCAB, (22,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_greedy(hf, ids, STEPS)

    def greedy(model: str, **knobs) -> list[int]:
        engine = Engine(EngineConfig(model=model, device="cpu", page_size=4, num_pages=64, **knobs))
        return run_all(engine, {"g": (ids, GREEDY)})["g"]

    assert greedy(str(safetensors)) == want
    assert greedy(str(gguf_path), gguf_quantized=False) == want
    # The CPU's default keeps the Q8_0 blocks (int8 activations in its GEMV): the same
    # model, rounded otherwise, so a near-tie late in the run may go the other way.
    assert agreeing_prefix(greedy(str(gguf_path)), want) >= STEPS // 2
