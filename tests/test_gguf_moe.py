"""GGUF files of mixtures of experts, written here the way llama.cpp writes them (each
layer's experts stacked in ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps``, Q8_0;
Mixtral as a ``llama`` file with ``expert_count``; Qwen2-MoE's shared expert as
``*_shexp``): converted, their experts dequantized and split per expert, and the model's
logits equal transformers' on the same weights."""

from __future__ import annotations

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_gguf_convert import VOCAB, write_gguf  # noqa: E402

from engine.loader.load import load_model  # noqa: E402
from engine.loader.resolve import resolve_model  # noqa: E402

CASES = {  # our tiny model kind -> (GGUF architecture, Hugging Face architecture)
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeForCausalLM"),
    "mixtral": ("llama", "MixtralForCausalLM"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_moe_gguf_converts_and_matches_transformers(kind, tmp_path, monkeypatch, make_tiny_hf_model, paged_runner):
    gguf_arch, architecture = CASES[kind]
    hf = make_tiny_hf_model(kind, None, vocab_size=VOCAB)
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(path, gguf_arch, hf)  # also rounds hf's weights to the Q8_0 values written
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))

    folder = resolve_model(str(path))

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture]
    model, mc = load_model(folder, "cpu", torch.float32)
    hf_sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert mc.moe_layers == hf_sparse  # a layer without a router in the file is dense
    assert (mc.num_experts, mc.num_experts_per_tok, mc.norm_topk_prob) == (
        hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts,
        hf.config.num_experts_per_tok,
        True if kind == "mixtral" else hf.config.norm_topk_prob,
    )
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    logits = paged_runner(model, mc).step({0: ids})[0]
    assert float((logits - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
