"""A dense model split between CUDA and the CPU (``--cpu-layers``): its first layers, the
embeddings and the head on the GPU, its last layers on the CPU over their host pool,
equal to the unsplit model on greedy ids (float32 on both sides, so the two paths differ
only in summation order)."""

from __future__ import annotations

import pytest

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams

LAYERS = 4


def _greedy(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return out


@pytest.mark.parametrize("cpu_layers", [1, LAYERS - 1])
def test_split_across_cuda_and_cpu_equals_unsplit(tmp_path, make_tiny_hf_model, cpu_layers):
    make_tiny_hf_model("llama", tmp_path, num_hidden_layers=LAYERS)
    prompts = {"a": [11, 40, 7, 93, 120, 5, 61, 200, 17, 3, 44], "b": [150, 31, 77, 8, 2, 190, 66]}

    def engine(n: int) -> Engine:
        return Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", kv_cache=64 << 20,
                                   cpu_layers=str(n)))

    split = engine(cpu_layers)
    host = split.model.host_layers
    assert host is not None and host.start == LAYERS - cpu_layers
    assert split.pool.device.type == "cuda" and host.pool.device.type == "cpu"
    assert split.runner.graphs is None  # a split model decodes eagerly
    ours = _greedy(split, prompts)
    del split
    assert ours == _greedy(engine(0), prompts)


def test_a_live_move_down_and_back_up_keeps_the_unsplit_ids(tmp_path, make_tiny_hf_model):
    """``--cpu-layers auto`` on CUDA: requests prefilled on the whole device decode across
    a move of two layers to the CPU and back (``Engine.move_split``); the device pool
    drops and regains their buffers, the CUDA graphs are set aside while split and used
    again after, and the ids are the unsplit engine's."""
    import torch

    make_tiny_hf_model("llama", tmp_path, num_hidden_layers=LAYERS)
    prompts = {"a": [11, 40, 7, 93, 120, 5, 61, 200, 17, 3, 44], "b": [150, 31, 77, 8, 2, 190, 66]}
    config = dict(model=str(tmp_path), device="cuda", dtype="float32", kv_cache=64 << 20)
    whole = _greedy(Engine(EngineConfig(**config, cpu_layers="0")), prompts)
    engine = Engine(EngineConfig(**config, cpu_layers="auto"))
    graphs = engine.runner.graphs
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling))
    kv = engine.pool.nbytes
    for cpu in (2, 0):
        for _ in range(3):
            for o in engine.step():
                out[o.request_id].extend(o.token_ids)
        before = torch.cuda.memory_allocated()
        engine.move_split(cpu)
        assert engine.pool.nbytes == kv * (LAYERS - cpu) // LAYERS
        assert (torch.cuda.memory_allocated() < before) == (cpu > 0)
        assert engine.runner.graphs is (None if cpu else graphs)
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert out == whole
