"""gpt-oss's MXFP4 experts kept in their blocks: a tiny random gpt-oss whose experts are
written as MXFP4 (gguf's quantizer) in llama.cpp's GGUF gives the same greedy ids with its
experts kept in blocks (``--gguf-quantized``, the default) as dequantized at load
(``--no-gguf-quantized``) and as transformers over the same values; the plan prices the
kept experts at their block bytes. OpenAI's safetensors form is
``tests/test_gpt_oss.py``'s (its experts load into the same blocks)."""

from __future__ import annotations

import pytest
import torch
from model_checks import hf_greedy

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from test_engine import run_all  # noqa: E402
from test_gguf_convert import VOCAB  # noqa: E402
from test_gpt_oss_gguf import GREEDY, MXFP4, STEPS, write_gpt_oss_gguf  # noqa: E402

from engine.common.config import EngineConfig  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.layers.moe.quant_experts import QuantExperts  # noqa: E402
from engine.layers.moe.sparse_moe import Experts  # noqa: E402


@pytest.fixture(scope="module")
def mxfp4_gguf(tmp_path_factory, make_tiny_hf_model):
    """(transformers' model holding the file's values, the GGUF) under a cache folder of
    the module's own."""
    tmp = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf = make_tiny_hf_model("gpt_oss", None, vocab_size=VOCAB, swiglu_limit=7.0)
    write_gpt_oss_gguf(tmp / "tiny-gpt-oss.gguf", hf, MXFP4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HEADROOM_CACHE_DIR", str(tmp / "cache"))
        yield hf, tmp / "tiny-gpt-oss.gguf"


def test_gguf_experts_in_blocks_give_the_dequantized_greedy_ids(mxfp4_gguf):
    """On the CPU, the experts kept in MXFP4 blocks (biases and the clamped SwiGLU with
    them) and dequantized at load decode the same 14 greedy ids, transformers' too."""
    hf, path = mxfp4_gguf
    ids = torch.randint(3, VOCAB, (19,), generator=torch.Generator().manual_seed(7)).tolist()
    got = {}
    for kept in (True, False):
        engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64, gguf_quantized=kept))
        experts = engine.model.model.layers[1].mlp.experts
        if kept:
            assert isinstance(experts, QuantExperts) and experts.types == ("MXFP4",) * 3
            assert experts.biases is not None and experts.activation is not None
        else:
            assert isinstance(experts, Experts)
        got[kept] = run_all(engine, {"g": (ids, GREEDY)})["g"]
    assert got[True] == got[False] == hf_greedy(hf, ids, STEPS)


def test_gguf_plan_prices_the_experts_at_their_block_bytes(mxfp4_gguf):
    """The weight size a GGUF in blocks is planned with holds the experts at 17 bytes per
    32 weights, on the CPU as on CUDA, and that is what the loaded model holds."""
    from engine.layers.weight_census import model_weight_bytes
    from engine.loader.gguf_quant import gguf_weight_size, load_gguf_quantized
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import resolve_model

    hf, path = mxfp4_gguf
    config = load_model_config(resolve_model(str(path)))
    blocks = 3 * config.num_experts * config.moe_intermediate_size * config.hidden_size // 32 * 17
    for device_type in ("cpu", "cuda"):
        size = gguf_weight_size(path, config, torch.float32, device_type, cpu_blocks=False)
        assert size.expert_layer_bytes == (blocks,) * config.num_layers
    model = load_gguf_quantized(config, path, "cpu", torch.float32)
    kept = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert sum(b.nbytes for m in kept for b in m.buffers()) == blocks * config.num_layers
    assert model_weight_bytes(model) < sum(p.nbytes for p in hf.parameters())
