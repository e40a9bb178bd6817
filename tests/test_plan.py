"""The memory plan on simulated devices: the ledger's arithmetic, the misfit message's
knobs and directions, and the engine sizing its pool from the plan (a fixed workspace the
plan must charge; a prompt larger than the KV pool, rejected at once)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.commands.plan import build_plan, render
from engine.common.config import EngineConfig
from engine.common.errors import PlanDoesNotFit
from engine.layers.attention.registry import register_backend
from engine.layers.attention.torch_backend import TorchAttentionBackend
from engine.memory.device import simulated_device
from engine.memory.ledger import make_plan
from engine.memory.plan import Footprint, GiB, MiB, PlanKnobs, fmt_bytes, reserve_for
from engine.memory.plan_fit import fit_plan

FLAG_TO_KNOB = {
    "--max-prefill-tokens": "max_prefill_tokens",
    "--max-running-requests": "max_running_requests",
    "--max-model-len": "max_model_len",
    "--min-context": "min_context",
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
    # The floor is the whole context: a plan short of it does not fit.
    knobs = PlanKnobs(max_prefill_tokens=8192, max_running_requests=64, min_context=8192)
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
    # For this small model the desktop reserve frees most; the batch and the context
    # floor (--min-context, 2048 tokens by default) less (priced, and ranked below).
    assert flags[0] == "--reserve" and "--min-context" in flags, flags
    for s in one.suggestions:
        if s.flag in ("--max-prefill-tokens", "--min-context", "--max-running-requests"):
            assert int(s.proposed) < int(s.current)
        assert s.saves_bytes > 0
        assert f"{s.flag} {s.current} → {s.proposed} frees about" in msg


def test_a_card_that_cannot_hold_the_weights_fails_before_they_load(default_model_dir, monkeypatch):
    import engine.core.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("weights were loaded for a plan that cannot fit")

    import engine.core.weights_stage as weights_stage

    monkeypatch.setattr(weights_stage, "load_model", no_load)
    with pytest.raises(PlanDoesNotFit) as err:
        engine_mod.Engine(EngineConfig(model=default_model_dir, device_total=1 * GiB,
                                       device_display=True))
    assert "--min-context" in str(err.value) and "does not fit" in str(err.value)


def test_f1_engine_charges_its_backends_workspace(default_model_dir):
    from engine.core.engine import Engine

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
    from engine.common.errors import RequestRejected
    from engine.core.engine import Engine
    from engine.wire.messages import GenerateRequest

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


# -- fit the card: a lowered context above the floor instead of a refusal -----------------


def test_a_tight_card_lowers_the_context_by_pages_down_to_the_floor():
    """Budget for 3,000 tokens of KV past the fixed sizes: the plan fits with the context
    lowered to whole pages, says why, and refuses only below ``min_context``."""
    dev = simulated_device(8 * GiB, 7 * GiB)
    knobs = PlanKnobs(page_size=16, reserve=0, safety_margin_bytes=0, max_running_requests=8)
    probe = make_plan(dev, knobs, _footprint(weight_bytes=0))
    kv_per_token = 64 * 1024
    fp = _footprint(weight_bytes=probe.budget_bytes - probe.fixed_bytes - 3000 * kv_per_token)
    plan = make_plan(dev, knobs, fp)
    assert plan.fits and plan.context_lowered
    assert plan.max_context_tokens == 3000 // 16 * 16 == plan.num_pages * 16
    assert (plan.wanted_context_tokens, plan.min_context_tokens) == (8192, 2048)
    assert plan.context_note == "context 8,192 -> 2,992 tokens: 1.00 GiB held by other processes"
    assert plan.context_note in plan.table() and not plan.message()
    # A floor above what the pool holds: no fit, and the floor is priced as a fix.
    high = make_plan(dev, dataclasses.replace(knobs, min_context=4096), fp)
    assert not high.fits and not high.context_lowered and not high.context_note
    floor = next(s for s in high.suggestions if s.flag == "--min-context")
    assert (floor.current, floor.proposed) == ("4096", "1024")
    assert floor.saves_bytes >= high.shortfall_bytes  # a lower floor alone fixes it
    # With the whole card free, the same footprint gets the full context and no note.
    whole = make_plan(simulated_device(8 * GiB, 8 * GiB), knobs, fp)
    assert whole.max_context_tokens == 8192 and not whole.context_lowered and not whole.context_note


def test_fit_plan_halves_the_chunk_only_to_reach_the_floor():
    """The prefill chunk is halved while the plan does not hold the floor; a plan that
    holds it with a lowered context keeps the configured chunk."""
    dev = simulated_device(8 * GiB, 8 * GiB)
    base = PlanKnobs(page_size=16, reserve=0, safety_margin_bytes=0, max_prefill_tokens=2048, min_context=2048)

    def planner_for(kv_tokens_at_256: int):
        # Each token of chunk costs 1 MiB of activation; at a chunk of 256 the budget
        # leaves ``kv_tokens_at_256`` tokens of KV.
        probe = make_plan(dev, base, _footprint(weight_bytes=0, activation_peak_bytes=0))
        weights = probe.budget_bytes - probe.fixed_bytes - kv_tokens_at_256 * 64 * 1024 - 256 * MiB

        def plan(k: PlanKnobs):
            return make_plan(dev, k, _footprint(weight_bytes=weights, activation_peak_bytes=0,
                                                activation_at=lambda kk: kk.max_prefill_tokens * MiB))
        return plan

    # Each token of chunk above 256 costs 16 tokens of KV: with 16,000 tokens at 256
    # there are none at 2048 and 3,712 at 1024 (above the floor, below the context).
    plan, knobs = fit_plan(planner_for(16_000), base)
    assert plan.fits and knobs.max_prefill_tokens == 1024 and plan.max_prefill_tokens == 1024
    assert plan.context_lowered
    # Plenty at 2048 for the floor, not for the whole context: the chunk stays.
    plan, knobs = fit_plan(planner_for(28_672 + 4000), base)
    assert plan.fits and plan.context_lowered and knobs.max_prefill_tokens == 2048
    # Not even at the smallest chunk: the most running requests that fit there (their
    # sampler rows freed), the last resort.
    planner = planner_for(1000)
    plan, knobs = fit_plan(planner, base, fewer_requests=True)
    assert plan.fits and knobs.max_prefill_tokens == 256 and 1 <= knobs.max_running_requests < base.max_running_requests
    assert not planner(dataclasses.replace(knobs, max_running_requests=knobs.max_running_requests + 1)).fits
    assert not fit_plan(planner, base)[0].fits  # a number of requests a person gave is not lowered
    # Nothing fits even so: the plan at the configured knobs comes back.
    plan, knobs = fit_plan(planner_for(-100_000), base, fewer_requests=True)
    assert not plan.fits and knobs == base and plan.max_prefill_tokens == 2048


def test_an_engine_on_a_tight_card_starts_with_a_lowered_context_and_grows_it_back(default_model_dir):
    """The engine starts where it used to refuse, refuses a prompt over the lowered
    context, and a pool grown to its ceiling (one request of the model's context) gives
    the whole context back."""
    from engine.common.errors import RequestRejected
    from engine.core.engine import Engine
    from engine.wire.messages import GenerateRequest

    config = EngineConfig(model=default_model_dir, device_total=4 * GiB, device_free=3 * GiB, reserve=1 * GiB)
    engine = Engine(config)
    # `headroom plan` makes the same decision, in the same dtype on the same device.
    assert build_plan(config) == engine.plan
    lowered = engine.info.max_context_tokens
    assert 2048 <= lowered < 8192 and engine.plan.context_lowered
    assert engine.info.model_context_tokens == 8192
    with pytest.raises(RequestRejected) as err:
        engine.add_request(GenerateRequest(request_id="long", prompt_token_ids=[7] * lowered))
    assert err.value.code == "context_length_exceeded"
    assert engine.kv_pool_ceiling_pages == 8192 // 16 + 1 > engine.pool.num_pages
    engine.resize_kv_pool(engine.kv_pool_ceiling_pages)
    assert engine.max_context_tokens == engine.info.max_context_tokens == 8192
    engine.add_request(GenerateRequest(request_id="long", prompt_token_ids=[7] * lowered))
    assert engine.has_work()  # queued, not refused


def test_a_device_limit_names_the_smaller_card_it_plans_for():
    """The plan's head names the card the ledger is for, not the larger device behind it."""
    dev = simulated_device(24 * GiB)
    plan = make_plan(dev, PlanKnobs(device_limit=4 * GiB), _footprint())
    assert plan.device == "simulated device (24.00 GiB) as a 4.00 GiB card (--device-limit)"
    assert plan.ledger[0].bytes == 4 * GiB
    assert make_plan(dev, PlanKnobs(), _footprint()).device == "simulated device (24.00 GiB)"


def test_reserves_beyond_the_device_read_as_short_never_as_a_negative_budget():
    dev = simulated_device(100 * MiB, 100 * MiB, display_attached=True)
    plan = make_plan(dev, PlanKnobs(page_size=16, safety_margin_bytes=100 * MiB), _footprint())
    short = reserve_for(100 * MiB, True) + 100 * MiB - 100 * MiB
    assert not plan.fits and plan.budget_bytes == -short
    line = next(e for e in plan.ledger if e.name == "budget")
    assert line.bytes == 0 and line.source == f"does not fit: {short // MiB} MiB short"
    message = plan.message()
    assert f"its budget does not fit, {short // MiB} MiB short" in message and "-" not in message.split("\n")[0]


def test_a_simulated_card_below_a_gib_is_named_in_mib():
    assert simulated_device(5 * MiB).name == "simulated device (5 MiB)"  # was "(0.00 GiB)"
    assert simulated_device(24 * GiB).name == "simulated device (24.00 GiB)"


def test_a_reserve_past_the_card_is_answered_with_the_automatic_one(default_model_dir):
    """``--reserve 100GiB`` on a 6 GiB card: halving it (50 GiB) would still leave nothing;
    the plan proposes the card's automatic reserve, with which it fits."""
    config = EngineConfig(model=default_model_dir, device_total=6 * GiB, reserve=100 * GiB)
    plan = build_plan(config)
    assert not plan.fits
    (lower,) = [s for s in plan.suggestions if s.flag == "--reserve"]
    auto = reserve_for(6 * GiB, True)
    assert lower.proposed == fmt_bytes(auto), lower
    assert build_plan(dataclasses.replace(config, reserve=auto)).fits


def test_too_many_running_requests_are_answered_with_the_most_that_fit(default_model_dir):
    """``--max-running-requests 100000`` on a 6 GiB card (the default model): the per-request
    buffers do not fit, and the plan proposes the most requests that do (a plan with them
    fits, one more does not), not only a quarter of the number asked for."""
    config = EngineConfig(model=default_model_dir, device_total=6 * GiB, max_running_requests=100_000)
    plan = build_plan(config)
    assert not plan.fits
    (most,) = [int(s.proposed) for s in plan.suggestions if s.flag == "--max-running-requests"]
    assert 64 < most < 25_000
    at_most = build_plan(dataclasses.replace(config, max_running_requests=most))
    assert at_most.fits and at_most.max_prefill_tokens == 2048 and at_most.cpu_layers == 0
    over = build_plan(dataclasses.replace(config, max_running_requests=most + 1))  # one more: something else must give
    assert not over.fits or over.max_prefill_tokens < 2048 or over.cpu_layers > 0
    assert f"--max-running-requests 100000 → {most}" in render(plan, as_json=False)
