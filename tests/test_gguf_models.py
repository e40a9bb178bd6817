"""GGUF files of each supported family load, written here with the ``gguf`` package's
writer the way llama.cpp writes them: Mistral and Ministral (llama architecture, a
SentencePiece tokenizer, head_dim apart from hidden/heads), Llama 3.2 (tied embeddings,
an end-of-turn token), next to the Qwen2/Qwen3/Llama 3.1 files of test_gguf_convert.py.
Logits are compared with transformers loading the same weights; the tokenizer and chat
template come from the file's metadata. Architectures headroom does not run are refused
before anything is written, naming them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_gguf_convert import LLAMA31_ROPE, VOCAB, write_gguf  # noqa: E402

from engine.common.load_errors import UnsupportedArchitecture  # noqa: E402
from engine.loader.load import load_model  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def sentencepiece_tokenizer(writer) -> None:
    """Mistral's tokenizer as llama.cpp writes it (``tokenizer.ggml.model = llama``):
    control tokens, the 256 byte fallbacks, then pieces with scores; ``VOCAB`` in all."""
    pieces = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", *LETTERS]
    assert len(pieces) == VOCAB
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * (1 + len(LETTERS))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 261 + [-float(i) for i in range(1 + len(LETTERS))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(MISTRAL_TEMPLATE)


def _logits_match(folder, hf, paged_runner) -> None:
    model, config = load_model(folder, "cpu", torch.float32)
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    logits = paged_runner(model, config).step({0: ids})[0]
    assert float((logits - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_mistral_gguf_loads_with_its_sentencepiece_tokenizer(tmp_path, monkeypatch, make_tiny_hf_model,
                                                             paged_runner):
    hf = make_tiny_hf_model("mistral", None, vocab_size=VOCAB)
    path = tmp_path / "tiny-mistral.gguf"
    write_gguf(path, "llama", hf, tokenizer=sentencepiece_tokenizer)
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))

    folder = resolve_model(str(path))

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 32
    _logits_match(folder, hf, paged_runner)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("hello").input_ids
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == "hello"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<s>[INST] hi [/INST]"


def test_llama32_gguf_ties_embeddings_and_ends_turns_at_eot(tmp_path, monkeypatch, make_tiny_hf_model,
                                                            paged_runner):
    hf = make_tiny_hf_model("llama", None, vocab_size=VOCAB, tie_word_embeddings=True,
                            rope_scaling=LLAMA31_ROPE, max_position_embeddings=16384)
    path = tmp_path / "tiny-llama32.gguf"
    write_gguf(path, "llama", hf, eot_token_id=2 + 1)  # <|im_end|> stands for <|eot_id|>
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))

    folder = resolve_model(str(path))

    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2, 3]
    _logits_match(folder, hf, paged_runner)


@pytest.mark.parametrize("arch", ["mistral3", "olmoe", "gemma2"])
def test_an_architecture_headroom_does_not_run_is_refused_before_anything_is_written(arch, tmp_path, monkeypatch):
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UnsupportedArchitecture) as err:
        resolve_model(str(path))
    assert repr(arch) in str(err.value) and "llama, qwen2, qwen3" in str(err.value)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not [p for p in models.iterdir() if not p.name.startswith(".sha256")]


def test_a_mistral_folder_loads_and_its_sliding_window_caps_the_context(tmp_path, make_tiny_hf_model,
                                                                        paged_runner):
    """A Hugging Face Mistral checkpoint (``MistralForCausalLM``) runs on the Llama layout;
    a sliding window shorter than the context caps the context at the window."""
    from engine.loader.hf_config import load_model_config

    hf = make_tiny_hf_model("mistral", tmp_path / "m", vocab_size=VOCAB)
    assert load_model_config(tmp_path / "m").max_position_embeddings == 128
    _logits_match(tmp_path / "m", hf, paged_runner)
    make_tiny_hf_model("mistral", tmp_path / "w", vocab_size=VOCAB, sliding_window=64)
    windowed = load_model_config(tmp_path / "w")
    assert (windowed.architecture, windowed.max_position_embeddings) == ("MistralForCausalLM", 64)
