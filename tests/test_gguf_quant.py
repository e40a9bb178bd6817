"""A GGUF loaded with its projections kept in block format (``--gguf-quantized``, on
CUDA) against the same file dequantized at load (the default), and the memory plan's
price of those weights against what the loader allocates.

On the CPU the quantized linears run the torch reference (``gguf``'s dequantizers);
float32 on both sides, so the logits agree to rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_gguf_convert import VOCAB, write_gguf  # noqa: E402

from engine.commands.plan import build_plan  # noqa: E402
from engine.common.config import EngineConfig  # noqa: E402
from engine.layers.linear.gguf_blocks import QuantLinear  # noqa: E402
from engine.layers.weight_census import model_weight_bytes  # noqa: E402
from engine.loader.default_model import default_gguf_path  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.gguf_quant import gguf_weight_size  # noqa: E402
from engine.loader.load import load_model  # noqa: E402

GiB = 1 << 30


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    tol = rel * max(1.0, float(b.abs().max()))
    diff = float((a - b).abs().max())
    assert diff <= tol, f"max |diff| {diff:.3g} > {tol:.3g}"


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory, make_tiny_hf_model):
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"quant-{arch}")
    path = tmp / f"tiny-{arch}.gguf"
    write_gguf(path, arch, make_tiny_hf_model(arch, None, vocab_size=VOCAB))
    return arch, path, convert_gguf(path, tmp / "hf")


def test_quantized_projections_give_the_dequantized_logits(tiny, paged_runner):
    arch, path, folder = tiny
    dense, config = load_model(folder, "cpu", torch.float32)
    quant, _ = load_model(folder, "cpu", torch.float32, quantized_gguf=path)
    linears = [m for m in quant.modules() if isinstance(m, QuantLinear)]
    # q/k/v, o, gate/up, down per layer; the qwen3 head is tied to the embeddings.
    assert len(linears) == 4 * config.num_layers + (arch != "qwen3")
    assert all([p.type_name for p in m.parts] == ["Q8_0"] for m in linears)
    if arch == "qwen2":
        assert quant.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = [5, 70, 3, 200, 42, 42, 9, 100]
    a, b = paged_runner(dense, config), paged_runner(quant, config)
    _close(b.step({0: ids[:6]})[0], a.step({0: ids[:6]})[0])
    for tok in ids[6:]:  # decode rows, one at a time
        _close(b.step({0: [tok]})[0], a.step({0: [tok]})[0])


def test_weight_size_is_what_the_loader_allocates(tiny):
    _, path, folder = tiny
    model, config = load_model(folder, "cpu", torch.bfloat16, quantized_gguf=path)
    size = gguf_weight_size(path, config, torch.bfloat16)
    assert size.bytes == model_weight_bytes(model)  # the RoPE cache counted on both sides
    assert "Q8_0 blocks" in size.mix and "bfloat16" in size.mix


def test_default_model_from_its_q4_1_blocks(default_model_dir, paged_runner):
    dense, config = load_model(default_model_dir, "cpu", torch.float32)
    quant, _ = load_model(default_model_dir, "cpu", torch.float32, quantized_gguf=default_gguf_path())
    types = {p.type_name for m in quant.modules() if isinstance(m, QuantLinear) for p in m.parts}
    assert types == {"Q4_1"}
    ids = [1, 504, 3458, 314, 253, 1345]
    _close(paged_runner(quant, config).step({0: ids})[0], paged_runner(dense, config).step({0: ids})[0], rel=1e-4)


def test_plan_charges_the_quantized_bytes_and_shows_the_mix(default_model_dir):
    """--gguf-quantized on a CUDA device: the plan charges the blocks; on a CPU what the
    CPU's default layout holds (the blocks with the C kernels, else their int4
    repacking). Off (CUDA's default) it charges the dequantized
    tensors the loader will place."""
    gguf_path = str(default_gguf_path())
    card = dict(model=gguf_path, device="cuda", device_total=4 * GiB)
    plan = build_plan(EngineConfig(**card, gguf_quantized=True))
    weights = next(e for e in plan.ledger if e.name == "weights")
    dense = build_plan(EngineConfig(**card))
    dense_weights = next(e for e in dense.ledger if e.name == "weights")
    on_cpu = build_plan(EngineConfig(model=gguf_path, device="cpu", device_total=4 * GiB, gguf_quantized=True))
    # With the C CPU kernels the 210 projections stay in their Q4_1 blocks and the tied
    # head reads the embeddings' Q8_0 blocks; with torch's int4 layout the projections and
    # the head are repacked. The CPU's default is the same.
    from engine.layers.linear.cpu_kernels import cpu_kernels

    cpu_weights = next(e for e in on_cpu.ledger if e.name == "weights")
    if cpu_kernels() is not None:
        assert "210 Q4_1 blocks" in cpu_weights.source and "2 Q8_0 blocks" in cpu_weights.source
    else:
        assert "211 int4 blocks" in cpu_weights.source and "1 Q8_0 blocks" in cpu_weights.source
    cpu_default = build_plan(EngineConfig(model=gguf_path, device="cpu", device_total=4 * GiB))
    assert next(e for e in cpu_default.ledger if e.name == "weights") == cpu_weights
    cpu_off = build_plan(EngineConfig(model=gguf_path, device="cpu", device_total=4 * GiB, gguf_quantized=False))
    assert next(e for e in cpu_off.ledger if e.name == "weights").source == "exact, from tensor shapes"
    from engine.loader.hf_config import load_model_config

    size = gguf_weight_size(gguf_path, load_model_config(default_model_dir), torch.bfloat16)
    assert weights.bytes == size.bytes
    assert "210 Q4_1 blocks" in weights.source and "Q8_0" in weights.source
    # Q4_1 holds 5 bits a weight against bfloat16's 16; the tied Q8_0 embedding and the
    # norms are bfloat16 on both sides.
    assert weights.bytes < 0.6 * dense_weights.bytes
    assert dense_weights.source == "exact, from tensor shapes"
    assert plan.num_pages > dense.num_pages


def test_plan_command_prices_blocks_only_with_the_flag(default_model_dir):
    """``headroom plan`` takes --gguf-quantized (and HEADROOM_GGUF_QUANTIZED) as serve
    does; without it the ledger's weights are the dequantized tensors."""
    from click.testing import CliRunner

    from service.cli.commands import main

    args = ["plan", "--model", str(default_gguf_path()), "--device", "cuda", "--device-total", "4GiB"]
    env = {"HEADROOM_CONFIG": os.devnull}
    default = CliRunner().invoke(main, args, env=env)
    flagged = CliRunner().invoke(main, [*args, "--gguf-quantized"], env=env)
    by_env = CliRunner().invoke(main, args, env={**env, "HEADROOM_GGUF_QUANTIZED": "1"})
    for result in (default, flagged, by_env):
        assert result.exit_code == 0, result.output
    assert "Q4_1 blocks" not in default.stdout and "exact, from tensor shapes" in default.stdout
    assert "210 Q4_1 blocks" in flagged.stdout and "210 Q4_1 blocks" in by_env.stdout


def _small_k_quant_gguf(tmp_path, seed: int):
    """The benchmark's random Q4_K_M-like file on a small Llama layout: ``(config, path)``."""
    import numpy as np

    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_gguf
    from engine.loader.hf_config import load_model_config

    folder = write_shape("llama-3.1-8b", tmp_path / "cfg", hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                         max_position_embeddings=64, rope_scaling=None)
    config = load_model_config(folder)
    path = tmp_path / "k.gguf"
    write_random_gguf(path, config, np.random.default_rng(seed))
    return config, path


def test_benchmark_gguf_of_k_quants_loads_in_blocks(tmp_path, paged_runner):
    """The benchmark's random Q4_K_M-like file (K-quant blocks built directly), on a
    small Llama layout: loaded in blocks, priced exactly, finite logits."""
    from engine.loader.gguf_quant import load_gguf_quantized

    config, path = _small_k_quant_gguf(tmp_path, 0)
    model = load_gguf_quantized(config, path, "cpu", torch.float32)
    types = {p.type_name for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts}
    assert types == {"Q4_K", "Q6_K"}
    size = gguf_weight_size(path, config, torch.float32)
    assert size.bytes == model_weight_bytes(model)
    logits = paged_runner(model, config).step({0: [1, 2, 3]})
    assert logits.shape == (1, 300) and bool(torch.isfinite(logits).all())


def test_q6k_projections_repacked_for_the_kernels_keep_their_bytes_and_logits(tmp_path, paged_runner):
    """What the loader does on CUDA (``QuantLinear.repack_for_kernels``), here on the CPU:
    Q6_K parts whose rows are an even number of blocks (down, K = 2 blocks) become
    ``Q6_K_P`` planes; v (K = 1 block) stays in GGUF blocks. The bytes held do not change
    (the plan's price holds), the logits are the same, and the benchmark's helper turns
    the layout back exactly."""
    from engine.bench.quant import set_q6k_layout
    from engine.loader.gguf_quant import load_gguf_quantized

    config, path = _small_k_quant_gguf(tmp_path, 1)
    model = load_gguf_quantized(config, path, "cpu", torch.float32)
    before = {n: b.clone() for n, b in model.named_buffers() if b.dtype == torch.uint8}
    held = model_weight_bytes(model)
    logits = paged_runner(model, config).step({0: [4, 5, 6]})
    set_q6k_layout(model, True)
    layer = model.model.layers[0]
    assert [p.type_name for p in layer.mlp.down_proj.parts] == ["Q6_K_P"]
    assert [p.type_name for p in layer.self_attn.qkv_proj.parts] == ["Q4_K", "Q6_K"]
    assert model_weight_bytes(model) == held
    assert not torch.equal(layer.mlp.down_proj.part0, before["model.layers.0.mlp.down_proj.part0"])
    _close(paged_runner(model, config).step({0: [4, 5, 6]}), logits)
    set_q6k_layout(model, False)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers() if n in before)
    assert [p.type_name for p in layer.mlp.down_proj.parts] == ["Q6_K"]


@pytest.mark.parametrize("argv,message", [
    (["--shape", "bogus"], "invalid choice: 'bogus'"),
    (["--layers", "0"], "0 is not 1 or more"),
    (["--batches", "abc"], "'abc' is not a comma-separated list of batch sizes"),
    (["--shape", "qwen3-0.6b", "--layers", "40", "--write-gguf", "x.gguf"], "qwen3-0.6b has 28 layers"),
    (["--shape", "smollm2-135m", "--write-gguf", "x.gguf"], "hidden size 576 is not a multiple of 256"),
    (["--shape", "qwen3-next-80b-a3b", "--write-gguf", "x.gguf"], "hybrid (linear-attention) models"),
    (["--write-gguf", "missing/x.gguf"], "is not an existing folder"),
    (["--write-gguf", "."], "is a directory"),
    (["--profile-prefill", "-3"], "a prompt of 1 or more tokens"),
])
def test_the_quant_benchmark_refuses_bad_arguments_before_any_work(argv, message, tmp_path, monkeypatch, capsys):
    """One argparse line (exit 2) naming the fix, before a weight is generated."""
    from engine.bench.quant import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_quant_benchmark_without_a_gpu_names_what_works_without_one(monkeypatch, capsys):
    from engine.bench.quant import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main([])
    assert "finds none here; --write-gguf PATH writes the random GGUF without one" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_norms_quantizing_for_the_int8_gemv_give_the_same_logits(tmp_path, paged_runner, monkeypatch, attention):
    """The decoder's norms and SiLU-and-mul (and, at a decode step on the Triton
    attention backend, the attention's split merge) writing their outputs quantized for
    the int8 GEMV (the default on CUDA) against the projections quantizing them in
    launches of their own (``--no-quant-int8-producer``): the same logits at rows
    of 3 and 1 tokens, with only the o projection's rows left to a quantizing launch
    where the attention cannot write them (torch's backend; the 3-token extend).
    Triton's interpreter on the CPU, bfloat16; bit for bit there (on CUDA the small
    projections split K with atomic adds, so to summation order)."""
    import numpy as np
    from triton_interpret import kernel_device

    from engine.bench.model_shapes import write_shape
    from engine.bench.random_gguf import write_random_gguf
    from engine.layers.linear import gguf_blocks as quant_linear
    from engine.loader.gguf_quant import load_gguf_quantized
    from engine.loader.hf_config import load_model_config
    from kernels import dispatch
    from kernels.quant import triton_activations, triton_int8
    from kernels.switches import using

    dev = kernel_device()
    if dev == "cpu":  # the Triton paths, interpreted, on CPU tensors
        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
        monkeypatch.setattr(quant_linear, "use_triton", lambda t: True)
    folder = write_shape("llama-3.1-8b", tmp_path / "cfg", hidden_size=256, intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=64, rope_scaling=None)
    config = load_model_config(folder)
    path = tmp_path / "k.gguf"
    write_random_gguf(path, config, np.random.default_rng(2))
    model = load_gguf_quantized(config, path, dev, torch.bfloat16)
    assert isinstance(model.lm_head, QuantLinear)
    launches = []
    quantize = triton_activations.quantize_activations

    def counted(x):
        launches.append(x.shape)
        return quantize(x)

    monkeypatch.setattr(triton_activations, "quantize_activations", counted)
    if dev == "cpu":  # 64 weight rows a program: few programs for the interpreter, either way
        gemv_parts = triton_int8.int8_gemv_parts
        monkeypatch.setattr(triton_int8, "int8_gemv_parts",
                            lambda x, parts, block_n=None, **kw: gemv_parts(x, parts, block_n=block_n or 64, **kw))
    logits = {}
    for producer in (True, False):
        launches.clear()
        with using(quant_int8_fuse=False, quant_int8_producer=producer):
            runner = paged_runner(model, config, device=dev, attention=attention)
            logits[producer] = [runner.step({0: [3, 1, 4]}), runner.step({0: [1]})]
        # Per step: o's rows alone (not at Triton's decode step), or q/k/v's, o's,
        # gate/up's, down's and the LM head's.
        own = 2 if attention == "torch" else 1
        assert len(launches) == (own if producer else 2 * (4 * config.num_layers + 1)), launches
    for on, off in zip(logits[True], logits[False], strict=True):
        assert bool(torch.isfinite(on).all())
        if dev == "cpu":
            assert torch.equal(on, off)
        else:
            _close(on, off, rel=2**-6)


def test_the_quant_benchmark_variants_set_each_switch_and_restore_them(monkeypatch):
    """``--variants`` times the decode step under each GEMV choice, the activations
    quantized by their norm or SiLU-and-mul among them, then the GEMM, and leaves the
    switches as it found them (here without a GPU: the timing is stubbed out)."""
    from engine.bench import quant as quant_bench
    from kernels.quant import triton_kernel as triton_quant

    seen = []

    def timed(model, config, batches, context, bandwidth, label):
        seen.append((label, quant_bench._gemv_switches(), triton_quant.gemv_max_rows()))
        return [label] * len(batches)

    monkeypatch.setattr(quant_bench, "decode_rows", timed)
    before = quant_bench._gemv_switches()
    rows = quant_bench.variant_rows(torch.nn.Module(), None, [1], 256, 1.0)
    assert quant_bench._gemv_switches() == before
    variants = quant_bench._GEMV_VARIANTS
    assert len(rows) == len(seen) == 2 * len(variants)  # Q6_K blocks, then planes; one batch: no GEMM rows
    for (label, switches, _), (name, int8, apart, parts, producer) in zip(seen, variants * 2, strict=True):
        assert label.endswith(name) and switches == (int8, not apart, parts, producer)
    assert sum(producer for *_, producer in variants) == 1


def test_a_gguf_keeps_its_blocks_on_cuda_by_default_unless_it_is_small(default_model_dir, caplog):
    """Unset ``--gguf-quantized`` on CUDA: blocks for a model of 1 GiB or more dequantized
    (an 8B shape: 15 GiB in bfloat16, so `serve --model x.gguf` fits a 12 GiB card), the
    bfloat16 weights for a smaller one (the 135M default model), each choice logged with
    its reason; asked for or refused, the flag wins; tensor parallel and ``--quantization
    fp8`` keep the dense load; the CPU keeps blocks."""
    import dataclasses
    import logging

    from engine.core.startup import SMALL_DENSE_BYTES, quantized_gguf
    from engine.loader.hf_config import load_model_config
    from engine.loader.weight_size import weight_bytes

    path = default_gguf_path()
    small = load_model_config(default_model_dir)  # the default GGUF, converted once per session
    assert weight_bytes(small, torch.bfloat16) < SMALL_DENSE_BYTES
    large = dataclasses.replace(small, num_layers=400, intermediate_size=16384)
    assert weight_bytes(large, torch.bfloat16) >= SMALL_DENSE_BYTES
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    unset = EngineConfig(model=str(path))
    with caplog.at_level(logging.INFO, logger="engine.core.startup"):
        assert quantized_gguf(unset, cuda, large) == path
        assert "kept in their blocks on CUDA" in caplog.text and "--no-gguf-quantized" in caplog.text
        assert quantized_gguf(unset, cuda, small) is None
        assert "dequantized to bfloat16" in caplog.text and "bound by kernel launches" in caplog.text
    assert quantized_gguf(dataclasses.replace(unset, gguf_quantized=True), cuda, small) == path
    assert quantized_gguf(dataclasses.replace(unset, gguf_quantized=False), cuda, large) is None
    assert quantized_gguf(dataclasses.replace(unset, tensor_parallel_size=2), cuda, large) is None
    assert quantized_gguf(dataclasses.replace(unset, quantization="fp8"), cuda, large) is None
    assert quantized_gguf(unset, cpu, small) == path


def test_a_tensor_of_the_wrong_shape_is_named_as_the_file_names_it(tmp_path, make_tiny_hf_model):
    """A norm one size too long in a GGUF kept in blocks: the error names the file, the
    tensor by llama.cpp's name (the model's after it) and the file's metadata, not the
    config.json the file never had."""
    import numpy as np

    from engine.common.load_errors import WeightMismatch
    from engine.core.engine import Engine

    hf = make_tiny_hf_model("qwen3", None, vocab_size=VOCAB)
    path = tmp_path / "badnorm.gguf"
    h = hf.config.hidden_size
    write_gguf(path, "qwen3", hf, override={"blk.0.attn_norm.weight": np.ones(h + 8, dtype=np.float32)})
    with pytest.raises(WeightMismatch) as e:
        Engine(EngineConfig(model=str(path), device="cpu", kv_cache=64 << 20))
    assert str(e.value) == (f"{path}: tensor blk.0.attn_norm.weight (model.layers.0.input_layernorm.weight) has shape "
                            f"({h + 8},), its metadata expects ({h},); the file's metadata and its tensors disagree")
