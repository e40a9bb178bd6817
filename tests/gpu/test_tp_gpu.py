"""Tensor parallel on two GPUs (NCCL): TP=2 gives TP=1's greedy ids on a random-weight
Qwen3-8B shape (4 of its 36 layers, weights saved by transformers, float32 so the split's different summation order
stays far below any argmax margin), with the decode step replayed from CUDA graphs on both ranks (the all-reduces
captured inside, rank 0's inputs broadcast device to device) and eagerly; a live shrink mid-decode drops the graphs
on both ranks, which capture again in step. ``bench_tp`` reports TP=2 with graphs. Skips unless two CUDA devices
are present.

The speed comparison is a command: ``python -m engine.bench.tensor_parallel --shape qwen3-8b --tp 2``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_engine import run_all

from engine.bench.model_shapes import SHAPES
from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import SamplingParams
from engine.worker.tp_launch import parallel_engine

# The graphs under tensor parallel are opt-in until this file has passed on two GPUs.
os.environ.setdefault("HEADROOM_TP_CUDA_GRAPHS", "1")

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _save_qwen3_8b_four_layers(path) -> None:
    """Random weights saved as a checkpoint: each rank loads its slices of the same
    tensors (``load_format="dummy"`` would draw each rank's own)."""
    import transformers

    cfg = dict(SHAPES["qwen3-8b"], num_hidden_layers=4)
    cfg.pop("architectures"), cfg.pop("model_type"), cfg.pop("torch_dtype")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg), dtype=torch.float32)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_tp2_greedy_equals_tp1_on_qwen3_8b_shape(tmp_path, graphs):
    _save_qwen3_8b_four_layers(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", kv_cache=2 << 30,
                          max_model_len=4096, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    requests = {str(i): (torch.randint(10, 151000, (n,), generator=g).tolist(), sp) for i, n in enumerate((7, 33, 130))}
    one = Engine(config)
    alone = run_all(one, requests)
    assert (one.runner.graphs is not None) is graphs
    del one
    torch.cuda.empty_cache()
    with parallel_engine(dataclasses.replace(config, tensor_parallel_size=2)) as engine:
        assert engine.device == torch.device("cuda:0")
        split = run_all(engine, requests)
        if graphs:
            assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
        else:
            assert engine.runner.graphs is None
    assert split == alone


def test_tp2_with_graphs_recaptures_in_step_after_a_live_shrink(tmp_path, make_tiny_hf_model):
    """The CPU test's shrink mid-decode (tests/test_tensor_parallel.py), on two GPUs with
    graphs: the resize drops both ranks' graphs, the next decode captures again on both
    (and they agree it worked), and the ids stay those of one GPU shrunk the same way."""
    from test_tensor_parallel import _shrunk_mid_decode

    make_tiny_hf_model("qwen3", tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", page_size=4, num_pages=128)
    one = Engine(config)
    alone, _ = _shrunk_mid_decode(one)
    assert one.runner.graphs is not None
    del one
    torch.cuda.empty_cache()
    with parallel_engine(dataclasses.replace(config, tensor_parallel_size=2)) as engine:
        captured = engine.runner.graphs.captures
        split, _ = _shrunk_mid_decode(engine)
        assert engine.rank_pool_pages == [16, 16]
        assert engine.runner.graphs.captures > captured and engine.runner.graphs.replays > 0
    assert split == alone


def test_bench_tp_reports_tp2_with_cuda_graphs(capsys):
    from engine.bench.tensor_parallel import main

    main(["--shape", "qwen3-8b", "--tp", "2", "--new-tokens", "8", "--also-eager"])
    out = capsys.readouterr().out
    assert "TP=1 (CUDA graphs)" in out and "TP=2 (CUDA graphs)" in out and "TP=2 (eager)" in out
