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
