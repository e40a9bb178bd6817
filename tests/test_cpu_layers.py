"""A dense model's last decoder layers on the CPU (``--cpu-layers``,
:mod:`engine.layers.host_layers`): here the "device" is the CPU too, but the split's
layers go through the split path (their own host pool, the CPU path's layers and C
decode layer), so the greedy ids must be the unsplit model's, and transformers'.
"""

from __future__ import annotations

import pytest
import torch
from model_checks import hf_greedy
from test_engine import run_all
from tiny_engine import tiny_engine

from engine.common.config import EngineConfig
from engine.common.errors import SettingRefused
from engine.core.engine import Engine
from engine.wire.messages import SamplingParams

STEPS = 12
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
LAYERS = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_tiny_hf_model):
    """A tiny random Llama of :data:`LAYERS` layers: ``(folder, transformers model)``."""
    path = tmp_path_factory.mktemp("tiny-llama-split")
    hf = make_tiny_hf_model("llama", path, num_hidden_layers=LAYERS)
    return str(path), hf


def _prompts() -> dict[str, list[int]]:
    shared = [11, 40, 7, 93, 120, 5, 61, 200, 17, 3]  # 10 tokens: two pages of 4 and part of a third
    return {"a": shared + [44, 9], "b": [150, 31, 77, 8, 2, 190, 66], "c": shared + [101]}


@pytest.mark.parametrize("cpu_layers", [1, LAYERS - 1])
def test_split_llama_decodes_transformers_greedy_ids(llama, cpu_layers):
    """Prefill, decode and several requests at once, then a prompt sharing a cached
    prefix: the split engine's ids are transformers'."""
    path, hf = llama
    engine = tiny_engine(path, 64, cpu_layers=str(cpu_layers))
    host = engine.model.host_layers
    assert host is not None and host.start == LAYERS - cpu_layers and host.pool.num_layers == cpu_layers
    assert engine.pool.num_layers == LAYERS - cpu_layers
    prompts = _prompts()
    first = run_all(engine, {rid: (ids, GREEDY) for rid, ids in prompts.items() if rid != "c"})
    hits = engine.stats().prefix_hit_tokens
    second = run_all(engine, {"c": (prompts["c"], GREEDY)})
    assert engine.stats().prefix_hit_tokens > hits  # "c" reused "a"'s cached pages
    assert host.pool.num_pages == engine.pool.num_pages  # one page count, one allocator
    for rid, out in {**first, **second}.items():
        assert out == hf_greedy(hf, prompts[rid], STEPS), rid


def test_the_profile_run_leaves_the_cpu_layers_out(llama, monkeypatch):
    """The plan's profile run measures the device's memory (measure_step_peak), which
    the CPU's layers do not use; run through them, a long prefill of an 8B's float32
    layers held the start for minutes. With ``device_only`` set, run returns copies of
    its inputs (the two device tensors a real step copies back) and runs no layer."""

    class Refuses(torch.nn.Module):
        def forward(self, *args):
            raise AssertionError("a CPU layer ran in the profile run")

    path, _ = llama
    host = tiny_engine(path, 16, cpu_layers="1").model.host_layers
    monkeypatch.setattr(host, "layers", [Refuses()])
    h, residual = torch.randn(3, 64), torch.randn(3, 64)
    host.device_only = True
    out_h, out_r = host.run(h, residual, None, host.pool.num_pages)
    assert torch.equal(out_h, h) and torch.equal(out_r, residual)
    assert out_h.data_ptr() != h.data_ptr() and out_r.data_ptr() != residual.data_ptr()


def test_auto_and_zero_keep_every_layer_on_the_device(llama):
    path, _ = llama
    for asked in ("auto", "0"):
        engine = tiny_engine(path, 16, cpu_layers=asked)
        assert engine.model.host_layers is None and engine.pool.num_layers == LAYERS


@pytest.mark.parametrize("extra", [0, 1])
def test_every_layer_or_more_on_the_cpu_is_refused_naming_the_largest(llama, extra):
    """One layer at least stays on the device (all of them crashed the worker once):
    every layer on the CPU is ``--device cpu``, which this engine runs on already."""
    path, _ = llama
    with pytest.raises(SettingRefused, match=f"has {LAYERS} decoder layers and one at least stays on the device; "
                       f"use --cpu-layers {LAYERS - 1} or fewer .* on --device cpu every layer runs on the CPU"):
        tiny_engine(path, 16, cpu_layers=str(LAYERS + extra))


def test_a_negative_count_is_refused_naming_the_choices():
    from engine.common.options import option_named

    for bad in ("-1", "\uff10", "\u0661"):  # a full-width and an Arabic-Indic digit are not numbers here
        problems = [check(bad) for check in option_named(EngineConfig, "cpu_layers").checks]
        assert any(p and "not auto or a whole number of decoder layers (0 or more)" in p for p in problems), bad
    checks = option_named(EngineConfig, "cpu_layers").checks
    assert [check("99999999999") for check in checks] == ["99999999999 is more decoder layers than any model has"]


def test_default_gguf_split_at_10_equals_unsplit():
    """The default model (SmolLM2-135M, Q4_1 blocks, 30 layers) with its last 10 layers
    through the split path: the same greedy ids as unsplit, by the C decode layer."""
    pytest.importorskip("gguf")
    from engine.loader.default_model import default_gguf_path

    def engine(**kw) -> Engine:
        return Engine(EngineConfig(model=str(default_gguf_path()), device="cpu", kv_cache=128 << 20, **kw))

    prompts = {"a": [1, 504, 3458, 282, 260, 2682, 30, 216], "b": [1, 12268, 253, 1109, 1352, 1]}
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    split = engine(cpu_layers="10")
    from engine.layers.linear.cpu_kernels import cpu_kernels

    assert split.model.host_layers.start == 20
    if cpu_kernels() is not None:  # the C decode layer runs both parts' decode steps
        assert split.model.host_layers.cpu_decode is not None and len(split.model.cpu_decode.specs) == 20
    ours = run_all(split, {rid: (ids, sampling) for rid, ids in prompts.items()})
    del split
    whole = run_all(engine(), {rid: (ids, sampling) for rid, ids in prompts.items()})
    assert ours == whole


# The default model's plan on a small simulated card (no display): at 1100 MiB it fits
# whole; at 900 MiB only with its last layers on the CPU; at 400 MiB not even so.
_SMALL = dict(device="cpu", device_display=False, max_running_requests=4, min_context=512)


def _default_gguf() -> str:
    pytest.importorskip("gguf")
    from engine.loader.default_model import default_gguf_path

    return str(default_gguf_path())


def test_auto_plans_no_split_when_the_model_fits():
    from engine.commands.plan import build_plan, render

    plan = build_plan(EngineConfig(model=_default_gguf(), device_total=1100 << 20, **_SMALL))
    assert plan.fits and plan.cpu_layers == 0 and not plan.split_note
    assert "on the CPU" not in render(plan, as_json=False)


def test_a_small_device_limit_plans_a_split_and_the_engine_runs_it():
    """The plan picks the fewest layers that fit and prints the split with its price; an
    engine on that card starts split so and answers."""
    from engine.commands.plan import build_plan, render

    config = EngineConfig(model=_default_gguf(), device_total=8 << 30, device_limit=900 << 20, **_SMALL)
    plan = build_plan(config)
    assert plan.fits and 0 < plan.cpu_layers < 30
    unsplit = build_plan(EngineConfig(**{**config.__dict__, "cpu_layers": "0"}))
    assert not unsplit.fits  # not even with the prefill chunk lowered to its floor
    text = render(plan, as_json=False)
    assert f"({plan.cpu_layers} of 30) run on the CPU (--cpu-layers {plan.cpu_layers})" in text
    assert "moved off the device" in text and "of host memory" in text and "fits: yes" in text
    engine = Engine(config)
    assert engine.model.host_layers.start == 30 - plan.cpu_layers
    out = run_all(engine, {"a": ([1, 504, 3458, 282, 260], SamplingParams(max_new_tokens=4, temperature=0.0))})
    assert len(out["a"]) == 4


def test_a_misfit_no_split_solves_is_refused_naming_cpu_layers():
    from engine.commands.plan import build_plan

    plan = build_plan(EngineConfig(model=_default_gguf(), device_total=600 << 20, **_SMALL))
    assert not plan.fits and plan.cpu_layers == 0
    assert "--cpu-layers auto → 29 frees about" in plan.message()


def test_a_split_on_a_roomy_card_sizes_its_pool_for_the_host_not_the_card():
    """The host pool of the layers on the CPU holds as many pages as the device's: a card
    with room to spare would make it larger than the host. The pool is capped at half of
    the host's available memory beside the layers' weights, and the note says no swap."""
    from engine.commands.plan import build_plan, render
    from engine.memory.host import host_memory

    config = EngineConfig(model=_default_gguf(), device_total=64 << 30, cpu_layers="29", **_SMALL)
    plan = build_plan(config)
    _, available = host_memory()
    assert plan.fits and plan.cpu_layers == 29 and "would swap" not in plan.split_note, plan.split_note
    host_pool = plan.num_pages * plan.page_size * plan.kv_bytes_per_token * 29  # one device layer's bytes a token
    assert host_pool <= available, (host_pool, available)
    assert "capped by the host pool of the CPU layers' KV" in render(plan, as_json=False)
    uncapped = build_plan(EngineConfig(**{**config.__dict__, "cpu_layers": "0"}))
    assert plan.num_pages < uncapped.num_pages


def test_an_estimated_split_keeps_the_placement_margin(tmp_path):
    """From estimates, auto puts on the CPU the fewest layers that leave the placement
    margin beyond one --min-context request (the weights loaded on the host stay there
    when the measured plan is made, whose CUDA context may come out larger than the
    estimate: 1,167 MiB against 512 on an H100), not merely the fewest that fit."""
    from engine.bench.model_shapes import write_shape
    from engine.commands.plan import build_plan
    from engine.memory.ledger import PLACEMENT_MARGIN_BYTES, _spare

    folder = write_shape("llama-3.1-8b", tmp_path)
    # A card one layer short of the model, a short context: the split takes about 4.4 GiB
    # of host memory (the margin's extra layer in float32 and the host KV pool), which any
    # CI machine has; a larger one could cap the split by the host instead.
    base = dict(model=str(folder), device="cpu", device_total=24 << 30, device_limit=15 << 30, device_display=False,
                dtype="bfloat16", max_running_requests=4, min_context=2048, max_model_len=4096)
    plan = build_plan(EngineConfig(**base))
    fewest = next(n for n in range(1, 32) if build_plan(EngineConfig(**base, cpu_layers=str(n))).fits)
    assert plan.fits and plan.cpu_layers > fewest, (plan.cpu_layers, fewest)
    assert _spare(plan) >= PLACEMENT_MARGIN_BYTES
    tighter = build_plan(EngineConfig(**base, cpu_layers=str(plan.cpu_layers - 1)))
    assert tighter.fits and _spare(tighter) < PLACEMENT_MARGIN_BYTES
