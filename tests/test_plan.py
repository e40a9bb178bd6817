"""The memory plan on simulated devices: the ledger's arithmetic, the misfit message's
knobs and directions, and the engine sizing its pool from the plan (a fixed workspace the
plan must charge; a prompt larger than the KV pool, rejected at once)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.attention.base import register_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.commands.plan import build_plan, render
from engine.config import EngineConfig
from engine.errors import PlanDoesNotFit
from engine.memory.device import simulated_device
from engine.memory.plan import Footprint, GiB, MiB, PlanKnobs, make_plan, reserve_for

FLAG_TO_KNOB = {
    "--max-prefill-tokens": "max_prefill_tokens",
    "--max-running-requests": "max_running_requests",
    "--max-model-len": "max_model_len",
}


@register_backend("test-workspace-256m")
class Workspace256Backend(TorchAttentionBackend):
    """A backend that declares a 256 MiB workspace (a fixed workspace the plan must
    charge before it sizes the pool)."""

    workspace_bytes = 256 * MiB


def _footprint(**kw) -> Footprint:
    base = dict(
        weight_bytes=2 * GiB,
        kv_bytes_per_token=64 * 1024,
        vocab_size=32000,
        model_context_tokens=8192,
        sampler_bytes_per_request=32000 * 37,
        activation_peak_bytes=600 * MiB,
    )
    base.update(kw)
    return Footprint(**base)


def test_ledger_arithmetic_is_exact():
    dev = simulated_device(8 * GiB, 7 * GiB, display_attached=True)
    knobs = PlanKnobs(page_size=16, max_running_requests=8, safety_margin_bytes=100 * MiB)
    fp = _footprint(workspace_bytes=(("attention", 256 * MiB),), runtime_bytes=300 * MiB)
    plan = make_plan(dev, knobs, fp)
    reserve = reserve_for(8 * GiB, True)
    budget = 8 * GiB - 1 * GiB - reserve - 100 * MiB
    fixed = 2 * GiB + 256 * MiB + 300 * MiB + 8 * 32000 * 37 + 600 * MiB
    page_bytes = 64 * 1024 * 16
    assert plan.budget_bytes == budget
    assert plan.fixed_bytes == fixed
    assert plan.num_pages == (budget - fixed) // page_bytes
    assert plan.kv_pool_bytes == plan.num_pages * page_bytes
    assert budget - fixed - plan.kv_pool_bytes < page_bytes  # all but a page's rounding goes to KV
    assert plan.fits
    names = [e.name for e in plan.ledger]
    for line in ("device total", "used by other processes", "desktop reserve", "safety margin", "weights",
                 "CUDA context and runtime", "attention", "sampler and logits", "prefill activation peak",
                 "CUDA graph pool", "KV cache pool"):
        assert any(line in n for n in names), line


def test_f1_declared_workspace_is_charged_and_the_message_names_knobs_that_shrink():
    knobs = PlanKnobs(max_prefill_tokens=8192, max_running_requests=64)
    dev = simulated_device(6 * GiB, 6 * GiB)
    fp = _footprint(weight_bytes=0, activation_peak_bytes=int(0.7 * GiB))
    probe = make_plan(dev, knobs, fp)
    need = 8192 * fp.kv_bytes_per_token
    # Weights sized so that KV for one full context fits with 100 MiB to spare.
    fp = dataclasses.replace(fp, weight_bytes=probe.budget_bytes - probe.fixed_bytes - need - 100 * MiB)
    fits_without = make_plan(dev, knobs, fp)
    with_ws = make_plan(dev, knobs, dataclasses.replace(fp, workspace_bytes=(("attention", 256 * MiB),)))
    assert fits_without.fits and not with_ws.fits
    assert with_ws.budget_bytes - with_ws.fixed_bytes == fits_without.budget_bytes - fits_without.fixed_bytes - 256 * MiB
    msg = with_ws.message()
    assert "does not fit" in msg and "more than the budget" in msg
    assert "ratio" not in msg
    assert with_ws.suggestions
    for s in with_ws.suggestions:
        if s.flag in FLAG_TO_KNOB:
            assert int(s.proposed) < int(s.current), s  # always towards less memory
            # Applying it really frees what it says.
            moved = dataclasses.replace(knobs, **{FLAG_TO_KNOB[s.flag]: int(s.proposed)})
            again = make_plan(dev, moved, fp_ws := dataclasses.replace(fp, workspace_bytes=(("attention", 256 * MiB),)))
            assert again.shortfall_bytes < with_ws.shortfall_bytes or again.fits, (s, fp_ws)


def test_default_model_on_6gib_card_fits_and_on_1gib_card_fails(default_model_dir):
    six = build_plan(EngineConfig(model=default_model_dir, device_total=6 * GiB,
                                  device_free=int(5.5 * GiB), device_display=True))
    assert six.fits and six.max_context_tokens == 8192
    text = render(six, as_json=False)
    assert "KV cache pool" in text and "fits: yes" in text
    kv = six.kv_pool_bytes
    assert kv >= 0.5 * six.budget_bytes  # most of what is left goes to the cache

    one = build_plan(EngineConfig(model=default_model_dir, device_total=1 * GiB,
                                  device_display=True))
    assert not one.fits
    msg = one.message()
    assert "1.00 GiB" in msg
    flags = [s.flag for s in one.suggestions]
    # For this small model the context and the desktop reserve dominate; the chunk
    # and batch knobs free less (they are priced, and ranked below).
    assert flags[:2] == ["--max-model-len", "--reserve"] or flags[:2] == ["--reserve", "--max-model-len"], flags
    for s in one.suggestions:
        if s.flag in ("--max-prefill-tokens", "--max-model-len", "--max-running-requests"):
            assert int(s.proposed) < int(s.current)
        assert s.saves_bytes > 0
        assert f"{s.flag} {s.current} → {s.proposed} frees about" in msg


def test_a_card_that_cannot_hold_the_weights_fails_before_they_load(default_model_dir, monkeypatch):
    import engine.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("weights were loaded for a plan that cannot fit")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    with pytest.raises(PlanDoesNotFit) as err:
        engine_mod.Engine(EngineConfig(model=default_model_dir, device_total=1 * GiB,
                                       device_display=True))
    assert "--max-model-len" in str(err.value) and "does not fit" in str(err.value)


def test_f1_engine_charges_its_backends_workspace(default_model_dir):
    from engine.engine import Engine

    cfg = dict(model=default_model_dir, device_total=int(2.2 * GiB), reserve=0,
               max_model_len=2048, max_prefill_tokens=512, max_running_requests=4)
    plain = Engine(EngineConfig(**cfg))
    charged = Engine(EngineConfig(**cfg, attention_backend="test-workspace-256m"))
    page = plain.plan.kv_pool_bytes // plain.plan.num_pages
    lost = plain.plan.num_pages - charged.plan.num_pages
    assert abs(lost * page - 256 * MiB) <= page
    assert any("attention backend (test-workspace-256m)" in e.name and e.bytes == 256 * MiB
               for e in charged.plan.ledger)
    # The pool the engine built is the plan's, plus the null page.
    assert charged.allocator.num_usable == charged.plan.num_pages
    assert charged.info.plan == charged.plan


def test_f5_context_follows_the_pool_and_a_prompt_over_it_is_refused(default_model_dir):
    from engine.engine import Engine
    from engine.errors import RequestRejected
    from engine.messages import GenerateRequest

    # Small enough that the pool, not the model, limits the context.
    engine = Engine(EngineConfig(model=default_model_dir, device_total=int(1.45 * GiB),
                                 reserve=0, max_prefill_tokens=512, max_running_requests=4,
                                 min_context=1024))
    limit = engine.info.max_context_tokens
    assert 1024 <= limit < 8192
    assert limit == engine.plan.max_context_tokens
    with pytest.raises(RequestRejected) as err:
        engine.add_request(GenerateRequest(request_id="long", prompt_token_ids=[7] * limit))
    assert err.value.code == "context_length_exceeded" and str(limit) in err.value.message
    assert not engine.has_work()


def test_plan_json_round_trips(default_model_dir):
    import msgspec

    from engine.memory.plan import MemoryPlan

    plan = build_plan(EngineConfig(model=default_model_dir, device_total=6 * GiB))
    back = msgspec.json.decode(render(plan, as_json=True), type=MemoryPlan)
    assert back == plan
