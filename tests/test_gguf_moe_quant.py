"""A mixture-of-experts GGUF loaded with its routed experts kept in block format
(:class:`~engine.layers.moe.quant_experts.QuantExperts`) against the same file with its
experts dequantized at load, and the memory plan's price of those blocks.

The file is a tiny Qwen3-MoE written here with gguf's writer, its experts as a Q4_K_M
file holds them (gate and up Q4_K, down Q6_K: K-quant blocks built directly, as
:mod:`kernels.quant.synthetic` does); on the CPU the experts in blocks run the C kernels
(:mod:`kernels.cpu.moe_experts`), whose activations go in as int16 codes per block of
32, so the logits agree within :data:`C_KERNEL_TOLERANCE` of their largest (to
rounding where the kernels do not build: the torch reference over ``gguf``'s
dequantizers), float32 on both sides.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_gguf_convert import VOCAB, write_gguf  # noqa: E402

from engine.common.config import EngineConfig  # noqa: E402
from engine.core.startup import quantized_gguf  # noqa: E402
from engine.layers.cpu_pack import pack_model_for_cpu  # noqa: E402
from engine.layers.moe.quant_experts import QuantExperts  # noqa: E402
from engine.layers.moe.sparse_moe import Experts  # noqa: E402
from engine.layers.weight_census import model_weight_bytes  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.gguf_quant import gguf_weight_size, load_gguf_quantized  # noqa: E402
from engine.loader.hf_config import load_model_config  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402

EXPERT_TYPES = ("Q4_K", "Q4_K", "Q6_K")
# Whole K-quant blocks (256 weights) along the hidden and expert sizes.
HIDDEN, MOE_INTERMEDIATE = 256, 256
STEPS = 16
# Relative to the largest logit: the int16 activation codes move each block's product by
# at most max|x_block| / 65534 * sum|w_block|, at gate/up and again at down.
C_KERNEL_TOLERANCE = 2e-4


def logits_tolerance(logits: torch.Tensor) -> float:
    """How far blocks' logits may be from the dequantized model's: the C kernels' bound
    where they run the experts, else float32 rounding."""
    from engine.layers.linear.cpu_kernels import cpu_kernels

    return (C_KERNEL_TOLERANCE if cpu_kernels() is not None else 1e-5) * max(1.0, float(logits.abs().max()))


def write_tiny_moe_gguf(folder, make_tiny_hf_model):
    """(GGUF path, config) of a 2-layer Qwen3-MoE in ``folder`` (layer 0 sparse, 8
    experts, top-2; layer 1 dense), its experts in :data:`EXPERT_TYPES`."""
    hf = make_tiny_hf_model("qwen3_moe", None, vocab_size=VOCAB, hidden_size=HIDDEN,
                            moe_intermediate_size=MOE_INTERMEDIATE)
    experts, rng = hf.config.num_experts, np.random.default_rng(0)
    override = {}
    for stem, type_name, rows, cols in (("ffn_gate_exps", EXPERT_TYPES[0], MOE_INTERMEDIATE, HIDDEN),
                                        ("ffn_up_exps", EXPERT_TYPES[1], MOE_INTERMEDIATE, HIDDEN),
                                        ("ffn_down_exps", EXPERT_TYPES[2], HIDDEN, MOE_INTERMEDIATE)):
        blocks = np.stack([random_blocks(type_name, rows, cols, rng, scale=2e-4) for _ in range(experts)])
        override[f"blk.0.{stem}.weight"] = (blocks, gguf.GGMLQuantizationType[type_name])
    path = folder / "tiny-qwen3moe.gguf"
    write_gguf(path, "qwen3moe", hf, override=override)
    return path, load_model_config(convert_gguf(path, folder / "hf"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, make_tiny_hf_model):
    return write_tiny_moe_gguf(tmp_path_factory.mktemp("moe-quant"), make_tiny_hf_model)


def test_quantized_experts_give_the_dequantized_greedy_ids_and_logits(tiny, paged_runner):
    path, config = tiny
    blocks = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    dense = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=False)
    experts = blocks.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.types == EXPERT_TYPES
    assert isinstance(dense.model.layers[0].mlp.experts, Experts)
    a, b = paged_runner(dense, config), paged_runner(blocks, config)
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    la, lb = a.step({0: ids})[0], b.step({0: ids})[0]
    greedy_a, greedy_b = [], []
    for _ in range(STEPS):
        assert float((la - lb).abs().max()) <= logits_tolerance(la)
        greedy_a.append(int(la.argmax()))
        greedy_b.append(int(lb.argmax()))
        la, lb = a.step({0: [greedy_a[-1]]})[0], b.step({0: [greedy_b[-1]]})[0]
    assert greedy_a == greedy_b


def test_weight_size_prices_the_expert_blocks(tiny):
    """On CUDA the plan charges the experts' blocks, byte for byte what the loader
    allocates; on the CPU (the projections repacked as the engine does) the blocks where
    the C kernels run them, else the experts' dense size (dequantized at load)."""
    path, config = tiny
    blocks = load_gguf_quantized(config, path, "cpu", torch.bfloat16, experts_in_blocks=True)
    size = gguf_weight_size(path, config, torch.bfloat16, "cuda")
    assert size.bytes == model_weight_bytes(blocks)
    assert "Q4_K blocks" in size.mix and "Q6_K blocks" in size.mix and "routed experts" in size.mix
    experts = blocks.model.layers[0].mlp.experts
    e, h, i = config.num_experts, HIDDEN, MOE_INTERMEDIATE
    assert sum(b.nbytes for b in experts.buffers()) == e * (2 * i * h // 256 * 144 + h * i // 256 * 210)
    from engine.layers.linear.cpu_kernels import cpu_kernels

    # Both CPU layouts: torch's int4 repacking, and the blocks as stored for the C kernels.
    for lib in (None, cpu_kernels()) if cpu_kernels() is not None else (None,):
        on_cpu = gguf_weight_size(path, config, torch.bfloat16, "cpu", cpu_blocks=lib is not None)
        loaded = load_gguf_quantized(config, path, "cpu", torch.bfloat16, embeddings_in_blocks=True,
                                     experts_in_blocks=None if lib is not None else False)
        packed = pack_model_for_cpu(loaded, torch.bfloat16, lib)
        assert isinstance(packed.model.layers[0].mlp.experts, Experts if lib is None else QuantExperts)
        assert on_cpu.experts_in_blocks == (lib is not None)
        assert on_cpu.bytes == model_weight_bytes(packed), lib


def test_startup_keeps_moe_blocks_on_cuda_with_experts_in_host_memory_too(tiny, caplog):
    """--cpu-experts N keeps the blocks on CUDA (the host tier and the expert cache hold
    them); on the CPU the C kernels run them in blocks, and without those kernels the
    experts are dequantized at load, with a log line."""
    from engine.layers.linear.cpu_kernels import cpu_kernels

    path, config = tiny
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert quantized_gguf(EngineConfig(model=str(path), gguf_quantized=True), cuda, config) == path
    hybrid = EngineConfig(model=str(path), gguf_quantized=True, cpu_experts="1")
    assert quantized_gguf(hybrid, cuda, config) == path
    with caplog.at_level(logging.INFO, logger="engine.core.startup"):
        assert quantized_gguf(EngineConfig(model=str(path), gguf_quantized=True), cpu, config) == path
        assert ("experts are dequantized at load" in caplog.text) == (cpu_kernels() is None)


def test_plan_command_shows_the_expert_blocks(tiny, tmp_path):
    """``headroom plan --gguf-quantized`` on a MoE GGUF prices the expert blocks."""
    import os

    from click.testing import CliRunner

    from service.cli.commands import main

    path, _ = tiny
    args = ["plan", "--model", str(path), "--device", "cuda", "--device-total", "4GiB", "--gguf-quantized"]
    result = CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_CACHE_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert "Q6_K blocks" in result.stdout and "routed experts" in result.stdout


def _random_moe_gguf(folder):
    """(path, config) of the benchmarks' random Qwen3-MoE GGUF (attention Q4_K, v Q6_K;
    experts Q4_K/Q4_K/Q6_K; LM head Q6_K) at a small Qwen3-30B-A3B-like shape."""
    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_moe_gguf

    shape = load_model_config(write_shape("qwen3-30b-a3b", folder / "cfg", hidden_size=256, moe_intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    path = folder / "moe.gguf"
    write_random_moe_gguf(path, shape, np.random.default_rng(0))
    return path, load_model_config(convert_gguf(path, folder / "hf"))


def test_cpu_layout_keeps_k_quant_projections_and_experts_in_blocks(tmp_path, paged_runner):
    """The CPU engine's layout of a Q4_K_M-like MoE file (where the C kernels build): its
    K-quant projections (attention, the LM head) stay in blocks for the C GEMV and its
    experts for the C MoE kernel, priced as loaded; fed the same tokens, its logits are
    the same file's dequantized at load within the kernels' activation rounding."""
    from engine.layers.linear.cpu_blocks import CpuBlockLinear
    from engine.layers.linear.cpu_kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None:
        pytest.skip("the C CPU kernels do not build here")
    path, config = _random_moe_gguf(tmp_path)
    ours = pack_model_for_cpu(load_gguf_quantized(config, path, "cpu", torch.float32, embeddings_in_blocks=True),
                              torch.float32, lib)
    layer = ours.model.layers[0]
    assert isinstance(layer.mlp.experts, QuantExperts) and isinstance(layer.self_attn.o_proj, CpuBlockLinear)
    # The layers' projections and the untied head interleaved by 16 rows where the build has AVX-512.
    from kernels.cpu import rows16

    x16 = rows16.SUFFIX if rows16.available(lib) else ""
    assert layer.self_attn.qkv_proj.types == ["Q4_K" + x16, "Q6_K" + x16] and ours.lm_head.types == ["Q6_K" + x16]
    # and the routed experts by 16 rows per expert
    assert layer.mlp.experts.types == tuple(t + x16 for t in EXPERT_TYPES)
    size = gguf_weight_size(path, config, torch.float32, "cpu", cpu_blocks=True)
    assert size.bytes == model_weight_bytes(ours)
    dense = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=False)
    a, b = paged_runner(dense, config), paged_runner(ours, config)
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    la, lb = a.step({0: ids})[0], b.step({0: ids})[0]
    for _ in range(STEPS // 2):
        assert float((la - lb).abs().max()) <= logits_tolerance(la)
        token = int(la.argmax())  # both fed the dequantized model's token
        la, lb = a.step({0: [token]})[0], b.step({0: [token]})[0]


def test_benchmark_moe_gguf_converts_and_loads_in_blocks(tmp_path, paged_runner):
    """The random Qwen3-MoE GGUF the GPU runs serve (K-quant blocks built directly, the
    default model's tokenizer), at a small Qwen3-30B-A3B-like shape: it converts (config
    and tokenizer from its metadata), its experts load in their Q4_K/Q4_K/Q6_K blocks,
    priced exactly, and a step gives finite logits."""
    from engine.bench.random_gguf import MOE_EXPERT_TYPES

    path, config = _random_moe_gguf(tmp_path)
    assert (config.architecture, config.num_experts, config.moe_layers) == ("Qwen3MoeForCausalLM", 4, (0, 1))
    model = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    assert all(layer.mlp.experts.types == MOE_EXPERT_TYPES for layer in model.model.layers)
    size = gguf_weight_size(path, config, torch.float32)
    assert size.bytes == model_weight_bytes(model)
    logits = paged_runner(model, config).step({0: [1, 2, 3]})
    assert logits.shape == (1, config.vocab_size) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("kind,arch", [("qwen2_moe", "qwen2moe"), ("mixtral", "llama")])
def test_other_families_load_their_experts_in_blocks(kind, arch, tmp_path, make_tiny_hf_model, paged_runner):
    """Qwen2-MoE (its shared expert's projections in blocks too) and Mixtral (a llama file
    with experts), Q8_0 as ``write_gguf`` stores them: blocks against dequantized."""
    from engine.layers.linear.gguf_blocks import QuantLinear

    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, arch, make_tiny_hf_model(kind, None, vocab_size=VOCAB))
    config = load_model_config(convert_gguf(path, tmp_path / "hf"))
    blocks = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    dense = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=False)
    for i in config.moe_layers:
        mlp = blocks.model.layers[i].mlp
        assert isinstance(mlp.experts, QuantExperts) and mlp.experts.types == ("Q8_0",) * 3
        if kind == "qwen2_moe":
            assert isinstance(mlp.shared_expert.gate_up_proj, QuantLinear)
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    la, lb = paged_runner(dense, config).step({0: ids})[0], paged_runner(blocks, config).step({0: ids})[0]
    assert float((la - lb).abs().max()) <= logits_tolerance(la)
