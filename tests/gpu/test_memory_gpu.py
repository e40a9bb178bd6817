"""The memory plan for real on a GPU, under an allocator cap the size of a desktop card:
the predicted peak against the measured one, a plan that cannot fit failing before any
weight loads (and the same model split with the CPU, its profile run leaving the CPU's
layers out), memory taken after the engine is ready failing one request (not the
engine), and a long prompt completing at the chunk the profile measured.

``torch.cuda.set_per_process_memory_fraction`` makes the caching allocator raise a real
``torch.OutOfMemoryError`` past the cap, so a 141 GB card behaves like a 6 GiB one.
"""

from __future__ import annotations

import pytest
import torch

from engine.bench.memory import predicted_allocator_bytes, worst_step_workload
from engine.bench.model_shapes import write_shape
from engine.common.config import EngineConfig
from engine.common.errors import PlanDoesNotFit
from engine.common.units import GiB
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams


def qwen3(tmp_path) -> str:
    return str(write_shape("qwen3-0.6b", tmp_path))


def run(engine: Engine, reqs: dict[str, list[int]], max_new: int = 8) -> dict:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    for rid, ids in reqs.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sp))
    final = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return final


def test_predicted_peak_matches_measured_within_3_percent(tmp_path, capped):
    capped(6 * GiB)
    # What the allocator still holds from earlier tests in this process: not the plan's.
    before = torch.cuda.memory_reserved()
    engine = Engine(EngineConfig(model=qwen3(tmp_path), load_format="dummy", device_limit=6 * GiB,
                                 reserve=0, max_model_len=4096, max_running_requests=4, max_prefill_tokens=2048))
    assert engine.plan.ledger[[e.name for e in engine.plan.ledger].index("prefill activation peak")].source.startswith("measured")
    torch.cuda.reset_peak_memory_stats()
    worst_step_workload(engine)
    predicted = predicted_allocator_bytes(engine.plan)
    measured = torch.cuda.max_memory_reserved() - before
    allocated = torch.cuda.max_memory_allocated() - before
    print(f"held before {before / GiB:.3f} GiB, predicted {predicted / GiB:.3f} GiB, measured reserved {measured / GiB:.3f} GiB, "
          f"allocated {allocated / GiB:.3f} GiB")
    assert abs(measured - predicted) <= 0.03 * predicted
    assert allocated <= predicted


def test_f1_plan_that_cannot_fit_fails_before_loading(tmp_path):
    """No layer on the CPU (``--cpu-layers 0``): 16 GB of bfloat16 weights on a 6 GiB card
    is refused before any loads."""
    before = torch.cuda.memory_allocated()
    with pytest.raises(PlanDoesNotFit) as err:
        Engine(EngineConfig(model=str(write_shape("llama-3.1-8b", tmp_path)), load_format="dummy",
                            device_limit=6 * GiB, reserve=0, cpu_layers="0"))
    assert "does not fit" in str(err.value)
    assert torch.cuda.memory_allocated() - before < 64 << 20  # 16 GB of weights never loaded


def test_f1_the_same_model_splits_and_its_profile_skips_the_cpu_layers(tmp_path, monkeypatch):
    """The default (``--cpu-layers auto``) puts the last layers on the CPU instead; the
    plan's measured step leaves their CPU work out (it measured their float32 prefill of
    the whole chunk for minutes before: past this test's timeout), and the engine answers."""
    from engine.layers.host_layers import HostLayers

    runs = []
    real_run = HostLayers.run
    monkeypatch.setattr(HostLayers, "run", lambda self, *a: (runs.append(self.device_only), real_run(self, *a))[1])
    engine = Engine(EngineConfig(model=str(write_shape("llama-3.1-8b", tmp_path)), load_format="dummy",
                                 device_limit=6 * GiB, reserve=0, max_model_len=2048))
    host = engine.model.host_layers
    assert host is not None and host.start < 32, "the plan put no layer on the CPU"
    assert True in runs, "the profile run ran the CPU layers"
    assert run(engine, {"a": list(range(10, 40))}, max_new=4)["a"].finish_reason == "length"
    assert runs[-1] is False  # the request's steps ran them


def test_f2_memory_taken_after_ready_fails_one_request_not_the_engine(tmp_path, capped):
    allowed = capped(6 * GiB)
    engine = Engine(EngineConfig(model=qwen3(tmp_path), load_format="dummy", device_limit=6 * GiB,
                                 reserve=0, max_model_len=8192, max_running_requests=8, max_prefill_tokens=4096))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    assert run(engine, {"warm": torch.randint(10, vocab, (64,), generator=g).tolist()})["warm"].finish_reason == "length"
    # Another "process" takes what is left under the cap (and the allocator's idle cache).
    torch.cuda.empty_cache()
    free_under_cap = allowed - torch.cuda.memory_reserved()
    hog = torch.empty(max(free_under_cap - 16 * (1 << 20), 0), dtype=torch.uint8, device="cuda")
    engine.drain_events()
    outcomes = {}
    for n in (1000, 1600, 2200, 3300):
        out = run(engine, {f"p{n}": torch.randint(10, vocab, (n,), generator=g).tolist()})[f"p{n}"]
        outcomes[n] = (out.finish_reason, out.error_code)
    events = engine.drain_events()
    print(outcomes, [(type(e).__name__, getattr(e, "action", None)) for e in events])
    # Every request got an answer: its tokens, or an out_of_memory error of its own.
    assert all(r == "length" or (r == "error" and c == "out_of_memory") for r, c in outcomes.values())
    assert any(type(e).__name__ == "OomEvent" for e in events), "the squeeze never bit"
    assert engine.allocator.num_free + (engine.radix.evictable_pages() if engine.radix else 0) == engine.allocator.num_usable
    del hog
    torch.cuda.empty_cache()
    after = run(engine, {"after": torch.randint(10, vocab, (3300,), generator=g).tolist()})["after"]
    assert after.finish_reason == "length"


def test_f3_long_prompt_completes_at_the_measured_chunk(tmp_path, capped):
    capped(6 * GiB)
    engine = Engine(EngineConfig(model=qwen3(tmp_path), load_format="dummy", device_limit=6 * GiB,
                                 reserve=0, max_model_len=32768, min_context=16384,
                                 max_running_requests=4, max_prefill_tokens=8192))
    ctx = engine.max_context_tokens
    print("context", ctx, "chunk", engine.knobs.max_prefill_tokens)
    assert ctx >= 16384
    ids = torch.randint(10, engine.model_config.vocab_size, (ctx - 16,)).tolist()
    out = run(engine, {"long": ids})["long"]
    assert out.finish_reason == "length", out
    assert not [e for e in engine.drain_events() if type(e).__name__ == "OomEvent"]
