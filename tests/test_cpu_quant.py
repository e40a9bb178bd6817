"""The CPU's quantized weights (``--gguf-quantized`` on the CPU): GGUF Q4_0/Q4_1 blocks
repacked into torch's int4 layout against ``gguf``'s dequantizers, the default model's
greedy answers against the float32 reference, and the plan's price against the bytes
the engine holds.

The repacking is exact (same weights); the int4 kernel accumulates in another order, so
products agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from test_engine import GREEDY, PROMPTS, run_all  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader.default_model import default_gguf_path  # noqa: E402
from engine.loader.gguf_quant import gguf_weight_size  # noqa: E402
from engine.loader.load import weight_bytes  # noqa: E402
from engine.models.cpu_quant_linear import (  # noqa: E402
    GROUP,
    CpuInt4Linear,
    int4_codes_scales_zeros,
    pack_int4,
)
from engine.models.quant_linear import PartSpec, QuantLinear, model_weight_bytes  # noqa: E402
from engine.text.chat import encode_chat  # noqa: E402
from engine.text.tokenizer import load_tokenizer  # noqa: E402
from kernels.quant import reference  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("rows", "cols", "m"), [(96, 64, 1), (192, 576, 3), (64, 1536, 16)])
def test_int4_packed_matmul_equals_the_dequantized_reference(type_name, rows, cols, m):
    blocks = torch.from_numpy(random_blocks(type_name, rows, cols, np.random.default_rng(rows + cols)))
    ref = reference.dequantize(blocks, type_name, cols)
    codes, scales, zeros = int4_codes_scales_zeros(blocks, type_name, cols)
    # The repacking is exact: the same weights as gguf's dequantizer.
    w = ((codes - 8).float().view(rows, -1, GROUP) * scales[..., None] + zeros[..., None]).view(rows, cols)
    assert torch.equal(w, ref)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(0))
    packed, scales_zeros = pack_int4(codes, scales, zeros, torch.float32)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
    torch.testing.assert_close(y, x @ ref.T, rtol=1e-5, atol=1e-4 * float(ref.abs().max()) * cols ** 0.5)


def test_cpu_linear_of_mixed_parts_equals_the_quant_linear_reference():
    """A fused projection whose shards differ in type: int4, other blocks dequantized,
    dense rows kept; with a bias."""
    rng = np.random.default_rng(1)
    cols = 64
    specs = [PartSpec(32, "Q4_1"), PartSpec(16, "Q8_0"), PartSpec(8, None), PartSpec(32, "Q4_0")]
    q = QuantLinear(cols, specs, bias=True, dtype=torch.float32)
    for spec, buf in q.part_views():
        if spec.type_name is None:
            buf.copy_(torch.randn(spec.rows, cols))
        else:
            buf.copy_(torch.from_numpy(random_blocks(spec.type_name, spec.rows, cols, rng)))
    q.bias.copy_(torch.randn(q.out_features))
    cpu = CpuInt4Linear.from_quant_linear(q, torch.float32)
    assert [int4 for _, int4 in cpu.kinds] == [True, False, False, True]
    x = torch.randn(2, 5, cols)
    torch.testing.assert_close(cpu(x), q(x), rtol=1e-5, atol=1e-3)


@pytest.fixture(scope="module")
def int4_engine():
    return Engine(EngineConfig(model=str(default_gguf_path()), device="cpu", kv_cache=256 << 20,
                               gguf_quantized=True))


def test_default_model_greedy_with_int4_weights_equals_float32(int4_engine, default_model_dir):
    """The 5 greedy prompts, 32 tokens each: the same ids as the float32 reference (the
    default engine, weights dequantized at load)."""
    linears = [m for m in int4_engine.model.modules() if isinstance(m, CpuInt4Linear)]
    assert len(linears) == 4 * int4_engine.model_config.num_layers
    assert not any(isinstance(m, QuantLinear) for m in int4_engine.model.modules())
    tokenizer = load_tokenizer(default_model_dir)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    requests = {f"p{i}": (ids, GREEDY) for i, ids in enumerate(prompts)}
    ours = run_all(int4_engine, requests)
    reference_engine = Engine(EngineConfig(model=str(default_gguf_path()), device="cpu", kv_cache=256 << 20))
    theirs = run_all(reference_engine, requests)
    for i in range(len(prompts)):
        assert ours[f"p{i}"] == theirs[f"p{i}"], (PROMPTS[i], tokenizer.decode(ours[f"p{i}"]))


def test_cpu_weight_size_is_what_the_engine_holds(int4_engine):
    """The plan's price of the repacked weights is the bytes the engine holds, and below
    the float32 tensors' (24 bytes a group of 32 against 128)."""
    mc = int4_engine.model_config
    size = gguf_weight_size(default_gguf_path(), mc, torch.float32, "cpu")
    assert size.bytes == model_weight_bytes(int4_engine.model) + mc.max_position_embeddings * mc.head_dim * 4
    assert "210 int4 blocks" in size.mix
    assert size.bytes < 0.6 * weight_bytes(mc, torch.float32)
