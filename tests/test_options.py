"""Options declared once (engine/options.py): what a field's metadata gives the CLI, the
environment and the config file, and the same names down the chain from the service's
settings to the engine config, the plan knobs and the scheduler config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from engine.config import EngineConfig
from engine.memory.plan import PlanKnobs
from engine.options import at_least, option, option_named, options_of, pick
from engine.scheduler.scheduler import SchedulerConfig


@dataclass(frozen=True)
class _Knobs:
    backend: str = option("auto", "Kernel family.", choices=("auto", "torch"))
    graph_batch: int | None = option(None, "Largest batch captured.", checks=(at_least(1),))
    pool: int | None = option(None, "Pool size.", kind="size")
    names: tuple[str, ...] = option((), "A name (repeatable).")
    quiet: bool = option(False, "Say less.")
    not_an_option: int = 3


def test_an_option_is_one_field_and_its_metadata():
    by_name = {o.name: o for o in options_of(_Knobs)}
    assert list(by_name) == ["backend", "graph_batch", "pool", "names", "quiet"]
    backend = by_name["backend"]
    assert (backend.flag, backend.env, backend.type) == ("--backend", "HEADROOM_BACKEND", str)
    assert backend.metavar == "auto|torch"
    assert backend.problem("cuda") == "'cuda' is not one of auto, torch"
    assert backend.problem("torch") is None
    graph = by_name["graph_batch"]
    assert (graph.flag, graph.env, graph.type) == ("--graph-batch", "HEADROOM_GRAPH_BATCH", int)
    assert graph.problem(0) == "must be at least 1"
    assert graph.problem(None) is None  # unset passes its checks
    assert (by_name["pool"].type, by_name["pool"].metavar) == (str, "SIZE")  # text until parsed
    assert by_name["names"].multiple and by_name["names"].type is str
    assert by_name["quiet"].type is bool


def test_an_option_default_must_be_immutable():
    with pytest.raises(TypeError, match="immutable"):
        option([], "A list default would be shared between instances.")


def test_every_engine_option_is_a_serve_option_of_the_same_name(tmp_path):
    from service.cli.settings import OPTIONS, resolve

    serve = {o.name: o for o in OPTIONS}
    for opt in options_of(EngineConfig):
        assert serve[opt.name] == opt
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    env = {"HEADROOM_MAX_PREFILL_TOKENS": "512", "HEADROOM_KV_CACHE": "64MiB", "HEADROOM_PORT": "9000"}
    settings = resolve({}, env=env, config_path=empty)
    engine = settings.engine_config()
    assert type(engine) is EngineConfig  # the service's own settings stay in the service
    for f in dataclasses.fields(EngineConfig):
        assert getattr(engine, f.name) == getattr(settings, f.name)
    assert (engine.max_prefill_tokens, engine.kv_cache) == (512, 64 << 20)


def test_plan_knobs_and_scheduler_config_take_the_engine_names_and_defaults():
    config_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(PlanKnobs):
        assert config_fields[f.name].default == f.default, f.name
    config = EngineConfig(max_prefill_tokens=512, page_size=32, reserve=1 << 30, min_context=1024)
    knobs = PlanKnobs.of(config)
    assert (knobs.max_prefill_tokens, knobs.page_size, knobs.reserve, knobs.min_context) == (
        512,
        32,
        1 << 30,
        1024,
    )
    sched = pick(knobs, SchedulerConfig, max_context_tokens=2048)
    assert (sched.max_prefill_tokens, sched.page_size, sched.max_running_requests) == (512, 32, 64)
    assert sched.max_context_tokens == 2048


def test_plan_suggestions_name_the_declared_flags():
    assert option_named(EngineConfig, "max_prefill_tokens").flag == "--max-prefill-tokens"
    with pytest.raises(KeyError):
        option_named(EngineConfig, "load_format")  # a field, not an option
