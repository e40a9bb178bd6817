"""Tensor parallel on the CPU (gloo): a group of two ranks gives the greedy ids of one
rank, on tiny random Qwen3 (tied embeddings, q/k norm, head_dim apart from hidden/heads)
and Llama (Llama 3.1 RoPE scaling), and a live shrink resizes both ranks' pools alike.
The same code runs on NCCL with one GPU per rank (tests/gpu/test_tp_gpu.py)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from test_engine import GREEDY, run_all

from engine.common.config import EngineConfig, ModelConfig
from engine.core.engine import Engine
from engine.parallel.shard import check_shardable
from engine.wire.messages import GenerateRequest, ResizeResult
from engine.worker.tp_launch import parallel_engine

pytestmark = pytest.mark.slow


def _prompts() -> dict:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 11, 23)]
    return {f"r{i}": (ids, GREEDY) for i, ids in enumerate(prompts)}


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tp2_greedy_equals_tp1(kind, tmp_path, make_tiny_hf_model):
    """32 greedy tokens of three prompts batched together; an odd vocabulary (251) so the
    last rank's vocabulary slice is the shorter one."""
    make_tiny_hf_model(kind, tmp_path, vocab_size=251)
    config = EngineConfig(model=str(tmp_path), device="cpu", page_size=4, num_pages=128)
    alone = run_all(Engine(config), _prompts())
    with parallel_engine(EngineConfig(**{**config.__dict__, "tensor_parallel_size": 2})) as engine:
        assert engine.tp.world == 2 and engine.model_config.num_kv_heads == 1
        split = run_all(engine, _prompts())
    assert split == alone
    assert all(len(ids) == 32 for ids in split.values())


def shrunk_mid_run(engine, filler: list[int], work: dict, pages: int, *, lead_steps: int = 1,
                   before_shrink=None) -> tuple[dict[str, list[int]], ResizeResult]:
    """Run ``work`` (``{id: (prompt ids, sampling)}``) after a ``filler`` prompt ran
    ``lead_steps`` steps alone and took the lowest pages; after 4 steps together the filler
    ends and the pool shrinks to ``pages`` (null page included; ``before_shrink()`` is
    called just before), then the run ends: ``(work's ids, the resize's result)``."""
    engine.add_request(GenerateRequest(request_id="filler", prompt_token_ids=filler, sampling=GREEDY))
    for _ in range(lead_steps):
        engine.step()
    for rid, (ids, sp) in work.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sp))
    out: dict[str, list[int]] = {}
    for _ in range(4):
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    engine.abort("filler")
    out.pop("filler", None)
    if before_shrink is not None:
        before_shrink()
    result = engine.resize_kv_pool(pages, reason="test")
    assert result.after_pages == pages
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out, result


def _shrunk_mid_decode(engine) -> tuple[dict[str, list[int]], int]:
    """The prompts after a 48-token filler took the lowest pages, the pool shrunk to 16
    pages after 4 steps (the prompts' pages above the cut relocate); ``(ids, relocated
    pages)``."""
    out, result = shrunk_mid_run(engine, list(range(3, 51)), _prompts(), 16)
    return out, result.relocated_pages


def test_tp2_live_shrink_reaches_both_ranks(tmp_path, make_tiny_hf_model):
    """A shrink with requests running: both ranks end at the new size (each reports its
    pool, rank 0 checks they agree), pages relocated alike, so the outputs stay those of
    one rank shrunk the same way."""
    make_tiny_hf_model("qwen3", tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", page_size=4, num_pages=128)
    alone, moved = _shrunk_mid_decode(Engine(config))
    assert moved > 0  # the shrink had pages to move: the relocation is exercised
    with parallel_engine(EngineConfig(**{**config.__dict__, "tensor_parallel_size": 2})) as engine:
        split, _ = _shrunk_mid_decode(engine)
        assert engine.rank_pool_pages == [16, 16]
    assert split == alone


def test_unsplittable_model_is_refused_with_the_fix():
    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=12,
                     num_layers=1, num_heads=3, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                     max_position_embeddings=16)
    # Three heads and one KV head: no size above 1 splits it, so 1 is the fix named.
    with pytest.raises(ValueError, match="do not divide by 2; .*use --tensor-parallel-size 1$"):
        check_shardable(mc, 2)
    # Each size with its own verb: the width is one number.
    with pytest.raises(ValueError, match=r"its 12 MLP width \(intermediate_size\) does not divide by 5"):
        check_shardable(mc, 5)


def test_unsplittable_model_fails_before_any_rank_starts(tmp_path, make_tiny_hf_model):
    """Four heads cannot split three ways: the error comes at once, no rank is spawned."""
    make_tiny_hf_model("llama", tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", num_pages=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="4 attention heads do not divide by 3") as refused, parallel_engine(config):
        pass
    assert not multiprocessing.active_children()
    # The fix names the sizes that do split it (heads 4, KV heads 2 in the tiny config).
    assert str(refused.value).endswith("use --tensor-parallel-size 2, or 1"), refused.value



def test_gemma4_is_refused_before_any_rank_starts(tmp_path, make_tiny_hf_model):
    """Gemma 4's layer kinds have heads of their own and share KV layers, which the split
    does not follow: refused from its config, naming size 1 (Gemma 3 splits:
    tests/test_tensor_parallel_ring.py)."""
    from engine.loader.hf_config import load_model_config

    make_tiny_hf_model("gemma4", tmp_path)
    with pytest.raises(ValueError, match="its layer kinds' own heads .* use --tensor-parallel-size 1$"):
        check_shardable(load_model_config(tmp_path), 2)
