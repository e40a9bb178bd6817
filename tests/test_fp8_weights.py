"""FP8 weights (``--quantization fp8`` and FP8 checkpoints) on the CPU: the projections
are float8_e4m3fn with a float32 scale per output row, upcast per call (the CUDA
``torch._scaled_mm`` path is in tests/gpu). The reference is the same model with each
projection's weight dequantized (``fp8 * scale``) into float32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.common.config import EngineConfig
from engine.common.load_errors import UnsupportedConfig
from engine.core.engine import Engine
from engine.layers.linear.fp8 import FP8_MAX, Fp8Linear, quantize_rows
from engine.loader.load import load_model
from engine.loader.weight_size import weight_bytes

FP8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_fp8_checkpoint(src, dst, *, per_channel: bool) -> None:
    """``src``'s float32 checkpoint rewritten as an FP8 one (what llm-compressor and
    vLLM write): projections float8_e4m3fn with ``weight_scale`` per tensor (``[]``)
    or per output channel (``[N, 1]``), and an ``input_scale`` the loader drops."""
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            if per_channel:
                q, scale = quantize_rows(t)
                scale = scale[:, None]
            else:
                scale = t.abs().max() / FP8_MAX
                q = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            out[name], out[name + "_scale"] = q, scale.float()
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
        else:
            out[name] = t
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config))


def _dequantized_reference(model):
    """A float32 copy of ``model``'s logits function: the same model loaded as FP8, with
    every Fp8Linear's weight upcast once (the product the FP8 path must equal)."""
    for module in model.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, Fp8Linear):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    lin.weight.copy_(child.dequantized(torch.float32))
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(module, name, lin)
    return model


def _logits(model, config, paged_runner, prompts):
    runner = paged_runner(model, config, page_size=4, num_pages=64)
    return runner.step({i: p for i, p in enumerate(prompts)})


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantized_at_load_equals_the_dequantized_model(kind, tmp_path, make_tiny_hf_model, paged_runner):
    """``--quantization fp8`` of a float32 checkpoint: every projection FP8 with
    per-row scales; logits equal the dequantized model's (same weights, float32
    products) and stay near the float32 model's."""
    make_tiny_hf_model(kind, tmp_path, vocab_size=128)
    fp8, config = load_model(tmp_path, "cpu", torch.float32, quantization="fp8")
    swapped = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(swapped) == 4 * config.num_layers and all(m.weight.dtype == FP8 for m in swapped)
    dense, _ = load_model(tmp_path, "cpu", torch.float32)
    ref = _dequantized_reference(load_model(tmp_path, "cpu", torch.float32, quantization="fp8")[0])
    prompts = [[5, 9, 17, 3, 44, 2, 8], [77, 1, 6]]
    have = _logits(fp8, config, paged_runner, prompts)
    torch.testing.assert_close(have, _logits(ref, config, paged_runner, prompts), atol=1e-5, rtol=1e-5)
    # e4m3 rounds each weight by up to 2**-4 of itself: measured <= 0.1 on these logits.
    torch.testing.assert_close(have, _logits(dense, config, paged_runner, prompts), atol=0.25, rtol=0)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_fp8_checkpoint_loads_as_stored(per_channel, tmp_path, make_tiny_hf_model, paged_runner):
    """An FP8 checkpoint (per-tensor or per-channel ``weight_scale``) loads its codes and
    scales as stored, with no option; the engine's greedy tokens equal those of the
    dequantized model, and the plan charges one byte per projection weight."""
    from test_engine import GREEDY, run_all

    src, dst = tmp_path / "f32", tmp_path / "fp8"
    make_tiny_hf_model("llama", src)
    _write_fp8_checkpoint(src, dst, per_channel=per_channel)
    model, config = load_model(dst, "cpu", torch.float32, quantization="fp8")
    stored = load_file(dst / "model.safetensors")
    q = model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(q.weight[: config.q_size].view(torch.uint8),
                       stored["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
    want_scale = stored["model.layers.0.self_attn.q_proj.weight_scale"].reshape(-1).expand(config.q_size)
    assert torch.equal(q.weight_scale[: config.q_size], want_scale)

    engine = Engine(EngineConfig(model=str(dst), device="cpu", page_size=4, num_pages=128))
    assert engine.quantization == "fp8"
    assert engine.weight_size.bytes == weight_bytes(config, torch.float32, "fp8") < weight_bytes(config, torch.float32)
    reference = Engine(EngineConfig(model=str(dst), device="cpu", page_size=4, num_pages=128))
    _dequantized_reference(reference.model)  # in place: the runner holds the same modules
    prompts = {f"r{i}": (list(range(3 + i, 20 + 3 * i)), GREEDY) for i in range(2)}
    assert run_all(engine, prompts) == run_all(reference, prompts)


def test_plan_charges_one_byte_per_projection_weight(tmp_path, make_tiny_hf_model):
    from engine.loader.hf_config import load_model_config

    make_tiny_hf_model("llama", tmp_path)
    config = load_model_config(tmp_path)
    dense = weight_bytes(config, torch.bfloat16)
    fp8 = weight_bytes(config, torch.bfloat16, "fp8")
    proj_weights = config.num_layers * (
        config.hidden_size * (config.q_size + 2 * config.kv_size) + config.q_size * config.hidden_size
        + 3 * config.hidden_size * config.intermediate_size)
    rows = config.num_layers * (config.q_size + 2 * config.kv_size + config.hidden_size
                                + 2 * config.intermediate_size + config.hidden_size)
    # bfloat16 -> 1 byte per weight, plus a float32 scale per output row.
    assert dense - fp8 == proj_weights * 2 - (proj_weights + 4 * rows)


def test_block_scaled_fp8_checkpoints_are_refused(tmp_path, make_tiny_hf_model):
    make_tiny_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfig, match="block scales"):
        Engine(EngineConfig(model=str(tmp_path), device="cpu", num_pages=16))
