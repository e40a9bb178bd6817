"""GGUF -> Hugging Face conversion on tiny GGUF files written here the way llama.cpp's
``convert_hf_to_gguf.py`` writes them (names, q/k permutation for llama, Q8_0 quants)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine.common.load_errors import (  # noqa: E402
    CorruptWeights,
    ModelLoadError,
    UnsupportedArchitecture,
    UnsupportedGGUFType,
)
from engine.loader import gguf_config, gguf_hf_tensors  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.gguf_hf_tensors import reverse_llama_permute  # noqa: E402
from engine.loader.load import load_model  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


# Two merges, not one: transformers 5.17's GGUF reader hands a one-element array back
# as its bare string, whose characters then fail as merges ("expected tuple of length
# 2"). Their products are in the vocabulary, as a BPE tokenizer requires.
MERGES = (("h", "e"), ("t", "h"))


def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + [a + b for a, b in MERGES]
    return tokens + [f"<extra_{i}>" for i in range(288 - len(tokens))]


VOCAB = len(_tokens())
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_cpp_rope_factors(theta: float, dim: int, rope: dict) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors`` of llama.cpp's convert_hf_to_gguf.py."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = 8192  # llama.cpp reads it from the top level, where Llama 3.1 has none
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_tensors(hf_name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """GGUF names and arrays of one transformers tensor: a layer's stacked experts
    (transformers 5 keeps gate and up in one ``[E, 2I, H]``) become llama.cpp's
    ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps``."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        layer = hf_name.split(".")[2]
        half = w.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half]), (f"blk.{layer}.ffn_up_exps.weight", w[:, half:])]
    if hf_name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight", w)]
    return [(_gguf_name(hf_name), w)]


def add_moe_metadata(writer, cfg) -> None:
    """llama.cpp's expert keys (``convert_hf_to_gguf.py``'s Qwen2MoeModel, Mixtral)."""
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _HF_TO_GGUF:
        return f"{_HF_TO_GGUF[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{suffix}"


def add_trunk_metadata(writer, cfg, extra_blocks: int = 0, rope_theta: float | None = None) -> None:
    """The keys every architecture's GGUF has, from a transformers config: layers (and
    ``extra_blocks`` after them), context, widths, heads, the RMSNorm epsilon, the RoPE
    base (``rope_theta``, else the config's), the vocabulary size."""
    writer.add_block_count(cfg.num_hidden_layers + extra_blocks)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if rope_theta is None else rope_theta)
    writer.add_vocab_size(cfg.vocab_size)


def add_byte_level_tokenizer(writer) -> None:
    """The tokenizer keys of a byte-level BPE of :data:`VOCAB` tokens (those of
    :func:`_tokens`, ids 0-2 special, BOS 1, EOS 2) and a plain chat template."""
    tokens = _tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_gguf(path, arch: str, hf, *, override: dict[str, np.ndarray] | None = None,
               tokenizer=None, eot_token_id: int | None = None, tensors: bool = True) -> None:
    """Write ``hf`` (a transformers model) as a GGUF. 2-D weights are stored Q8_0 and the
    transformers model is updated to their dequantized values, so both sides hold the
    same numbers. ``override`` replaces GGUF tensors by name: an array, or ``(blocks,
    GGMLQuantizationType)`` for raw blocks of that type. ``tokenizer(writer)`` writes the tokenizer's keys instead of the
    byte-level BPE one (tokens of :func:`_tokens`) and the chat template. ``tensors=False``
    writes the metadata and tokenizer alone, a vocab-only file as llama.cpp's
    ``ggml-vocab-*.gguf``."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_trunk_metadata(writer, cfg)
    writer.add_feed_forward_length(cfg.intermediate_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "qwen3" or head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    (tokenizer or add_byte_level_tokenizer)(writer)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    add_moe_metadata(writer, cfg)
    rope = cfg.rope_parameters
    if rope["rope_type"] == "llama3":
        factors = llama_cpp_rope_factors(rope["rope_theta"], cfg.head_dim, rope)
        writer.add_tensor("rope_freqs.weight", factors)
    names = list(dict.fromkeys(hf.state_dict())) if tensors else []  # tied weights appear once
    with torch.no_grad():
        for name in names:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            param = hf.get_parameter(name)
            w = param.detach().numpy().astype(np.float32)
            if w.ndim >= 2:  # matrices and stacked experts
                q = gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                w = gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
                param.copy_(torch.from_numpy(w))
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                w = llama_cpp_permute(w, heads)
            for gname, part in _gguf_tensors(name, w):
                if override and gname in override and isinstance(override[gname], tuple):
                    blocks, qtype = override[gname]  # raw blocks of a GGML type
                    writer.add_tensor(gname, blocks, raw_dtype=qtype)
                elif override and gname in override:
                    writer.add_tensor(gname, override[gname])
                elif part.ndim >= 2:
                    q = gguf.quantize(np.ascontiguousarray(part), gguf.GGMLQuantizationType.Q8_0)
                    writer.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                else:
                    writer.add_tensor(gname, part)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_converted_gguf_matches_transformers(
    arch, tmp_path, monkeypatch, make_tiny_hf_model, paged_runner
):
    overrides = {}
    if arch == "llama":  # Llama 3.1 scaling, which GGUF carries as llama.cpp's factors
        overrides = dict(rope_scaling=LLAMA31_ROPE, max_position_embeddings=16384)
    hf = make_tiny_hf_model(arch, None, vocab_size=VOCAB, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, hf)
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))

    folder = resolve_model(str(path))

    assert folder.parent == tmp_path / "cache" / "models"
    assert (folder / "tokenizer.json").is_file() and (folder / "chat_template.jinja").is_file()
    model, config = load_model(folder, "cpu", torch.float32)
    assert config.tie_word_embeddings == (arch == "qwen3")
    assert config.eos_token_ids == (2,)
    if arch == "llama":
        assert config.rope.rope_type == "llama3" and config.rope.factor == 8.0
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    logits = paged_runner(model, config).step({0: ids})[0]
    assert float((logits - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


@pytest.mark.parametrize("n_head", [4, 2])
def test_reverse_permute_inverts_llama_cpp(n_head):
    w = torch.randn(n_head * 8, 5)
    assert torch.equal(
        reverse_llama_permute(torch.from_numpy(llama_cpp_permute(w.numpy(), n_head)), n_head), w
    )


def test_llama3_rope_factors_become_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 RoPE scaling as a ``rope_freqs`` tensor of divisors."""
    from engine.common.config import RopeConfig
    from engine.layers.rope import inv_freq

    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)
    factors = (inv_freq(RopeConfig(theta=500000.0), 64) / inv_freq(rope, 64)).numpy()
    scaling = gguf_config._llama3_from_factors(
        factors, tmp_path, {"rope_theta": 500000.0, "head_dim": 64}
    )
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_unsupported_tensor_type_is_named(tmp_path, make_tiny_hf_model):
    hf = make_tiny_hf_model("qwen2", None, vocab_size=VOCAB)
    path = tmp_path / "bad.gguf"
    embed = np.zeros((VOCAB, hf.config.hidden_size), dtype=np.int8)  # stored as I8
    write_gguf(path, "qwen2", hf, override={"token_embd.weight": embed})
    out = tmp_path / "out"
    with pytest.raises(UnsupportedGGUFType) as e:
        convert_gguf(path, out)
    assert "token_embd.weight" in str(e.value) and "I8" in str(e.value)
    assert not out.exists()


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitecture, match="gpt2"):
        convert_gguf(path, tmp_path / "out")


def test_garbage_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(CorruptWeights, match="junk.gguf"):
        convert_gguf(path, tmp_path / "out")


def test_a_truncated_gguf_is_named_truncated(tmp_path, make_tiny_hf_model):
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, "qwen3", make_tiny_hf_model("qwen3", None, vocab_size=VOCAB))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size - 1000])
    with pytest.raises(CorruptWeights, match=r"cut.gguf is not a readable GGUF file \(tensor .* ends at byte "
                                             r"[\d,]+ of a [\d,]+-byte file: it is truncated\); download it again"):
        convert_gguf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def dies_at_fifth_tensor(dequantize):
    """``dequantize`` that raises KeyboardInterrupt (Ctrl-C halfway through the tensors)
    on its fifth call."""
    calls = []

    def dies_midway(tensor):
        calls.append(tensor.name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return dequantize(tensor)

    return dies_midway


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, make_tiny_hf_model):
    hf = make_tiny_hf_model("qwen2", None, vocab_size=VOCAB)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2", hf)
    out = tmp_path / "models" / "tiny"
    stale = tmp_path / "models" / ".tiny.partial-999999999"  # a dead converter's leftovers
    stale.mkdir(parents=True)
    real = gguf_hf_tensors.dequantize_tensor
    monkeypatch.setattr(gguf_hf_tensors, "dequantize_tensor", dies_at_fifth_tensor(real))
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, out)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []

    monkeypatch.setattr(gguf_hf_tensors, "dequantize_tensor", real)
    assert convert_gguf(path, out) == out
    assert (out / "model.safetensors").is_file()
    assert list((tmp_path / "models").iterdir()) == [out]


@pytest.mark.parametrize("eos", [VOCAB, -1])
def test_a_special_token_id_outside_the_vocabulary_is_named(eos, tmp_path, make_tiny_hf_model):
    """An EOS id past the vocabulary failed in transformers' tokenizer build ("IndexError:
    list index out of range"); a negative one converted, its EOS the vocabulary's last
    token by Python's indexing, so a reply never stopped. Both are refused, naming the key
    and how to set it."""
    def tokenizer(writer):
        tokens = _tokens()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
        writer.add_bos_token_id(1)
        writer.add_key_value("tokenizer.ggml.eos_token_id", eos, gguf.GGUFValueType.INT32)

    _refused_before_writing(tmp_path, make_tiny_hf_model, "bad.gguf", tokenizer,
                            rf"bad.gguf: tokenizer.ggml.eos_token_id is {eos}, outside its "
                            rf"{VOCAB}-token vocabulary .*gguf-set-metadata ")


def _refused_before_writing(tmp_path, make_tiny_hf_model, name: str, tokenizer, match: str) -> None:
    """A tiny Qwen3 GGUF named ``name`` whose tokenizer keys ``tokenizer(writer)`` writes is
    refused by its conversion with a message matching ``match``, nothing written."""
    path = tmp_path / name
    write_gguf(path, "qwen3", make_tiny_hf_model("qwen3", None, vocab_size=VOCAB), tokenizer=tokenizer)
    with pytest.raises(ModelLoadError, match=match):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_without_a_tokenizer_is_named(tmp_path, make_tiny_hf_model):
    """A file whose tokenizer keys were left out failed in transformers' words ("Cannot
    build a tokenizer from a GGUF file stating tokenizer None"); it is refused by name,
    before anything is written."""
    _refused_before_writing(tmp_path, make_tiny_hf_model, "notok.gguf", lambda writer: None,
                            r"notok.gguf holds no tokenizer \(no tokenizer.ggml.model or tokenizer.ggml.tokens key\)")


def test_a_chat_template_that_does_not_parse_is_named(tmp_path, make_tiny_hf_model):
    """A file whose tokenizer.chat_template does not parse (a cut download, a hand edit)
    converted, and `headroom serve` answered ready, then every chat request a 400 that
    blamed the request's messages. It is refused by name before anything is written,
    saying what the template lacks and how to replace it."""
    def tokenizer(writer):
        add_byte_level_tokenizer(writer)
        writer.kv_data[0].pop("tokenizer.chat_template", None)
        writer.add_chat_template("{% for m in messages %}{{ m.content ")

    _refused_before_writing(tmp_path, make_tiny_hf_model, "badtpl.gguf", tokenizer,
                            r"badtpl.gguf: its chat template \(tokenizer.chat_template\) does not parse "
                            r"\(line 1: unexpected end of template.*gguf-new-metadata --chat-template-file")
