"""Tensor parallel on two GPUs (NCCL): TP=2 gives TP=1's greedy ids on a random-weight
Qwen3-8B shape (4 of its 36 layers, weights saved by transformers, float32 so the split's different summation order
stays far below any argmax margin). Skips unless two CUDA devices are present.

The speed comparison is a command, not a test: ``python -m engine.commands.bench_tp
--shape qwen3-8b --tp 2``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import run_all

from engine.commands.model_shapes import SHAPES
from engine.config import EngineConfig
from engine.engine import Engine
from engine.messages import SamplingParams
from engine.parallel.launch import parallel_engine

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


def test_tp2_greedy_equals_tp1_on_qwen3_8b_shape(tmp_path):
    _save_qwen3_8b_four_layers(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", kv_cache=2 << 30,
                          max_model_len=4096)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    requests = {str(i): (torch.randint(10, 151000, (n,), generator=g).tolist(), sp) for i, n in enumerate((7, 33, 130))}
    alone = run_all(Engine(config), requests)
    torch.cuda.empty_cache()
    with parallel_engine(dataclasses.replace(config, tensor_parallel_size=2)) as engine:
        assert engine.device == torch.device("cuda:0")
        split = run_all(engine, requests)
    assert split == alone
