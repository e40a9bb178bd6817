"""Options declared once (engine/common/options.py): what a field's metadata gives the CLI, the
environment and the config file, and the same names down the chain from the service's
settings to the engine config, the plan knobs and the scheduler config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from engine.common.config import EngineConfig
from engine.common.options import at_least, option, option_named, options_of, pick
from engine.memory.plan import RUNNING_REQUESTS, PlanKnobs, prefill_chunk
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
    assert backend.problem("Torhc") == "'Torhc' is not one of auto, torch; did you mean torch?"  # a near miss named
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
    from service.common.settings import OPTIONS
    from service.common.settings_sources import resolve

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
        if f.name == "max_prefill_tokens":  # unset in the config: the plan takes the device's chunk
            assert config_fields[f.name].default is None and f.default == prefill_chunk("cuda")
            continue
        if f.name == "max_running_requests":  # unset: RUNNING_REQUESTS, or as many as the card holds
            assert config_fields[f.name].default is None and f.default == RUNNING_REQUESTS
            assert PlanKnobs.of(EngineConfig(max_running_requests=3)).max_running_requests == 3
            continue
        assert config_fields[f.name].default == f.default, f.name
    assert PlanKnobs.of(EngineConfig(device="cpu")).max_prefill_tokens == prefill_chunk("cpu") < prefill_chunk("cuda")
    assert PlanKnobs.of(EngineConfig(), "cpu").max_prefill_tokens == prefill_chunk("cpu")
    # A simulated card plans as the GPU it stands for.
    assert PlanKnobs.of(EngineConfig(device_total=4 << 30), "cpu").max_prefill_tokens == prefill_chunk("cuda")
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


# -- values as a person writes them, in each source ---------------------------------------


def _resolve_with(tmp_path, file_text: str = "", env: dict | None = None, flags: dict | None = None):
    from service.common.settings_sources import resolve

    config = tmp_path / "config.toml"
    config.write_text(file_text)
    return resolve(flags or {}, env=env or {}, config_path=config)


def test_word_or_number_options_take_a_number_from_every_source(tmp_path):
    """An option whose value is a word or a number (``--cpu-experts auto|none|N``,
    ``--keep-alive 5m|seconds``) takes TOML's bare number as the flag's text."""
    from service.common.settings import OPTIONS

    shaped = [o for o in OPTIONS if o.kind == "word_or_number"]
    assert {"cpu_experts", "keep_alive"} <= {o.name for o in shaped}
    for opt in shaped:
        for text in (f"{opt.name} = 2\n", f'{opt.name} = "2"\n'):
            assert getattr(_resolve_with(tmp_path, text), opt.name) == "2", text
        assert getattr(_resolve_with(tmp_path, env={opt.env: "2"}), opt.name) == "2"
        assert getattr(_resolve_with(tmp_path, flags={opt.name: "2"}), opt.name) == "2"
    assert _resolve_with(tmp_path, "keep_alive = 1.5\n").keep_alive_s == 1.5
    assert option_named(EngineConfig, "cpu_experts").metavar == "auto|none|N"


def test_an_empty_name_in_the_file_is_refused_as_the_flag_refuses_it(tmp_path):
    """A list's empty item from the config file was dropped unseen where the flag is
    refused; from a variable an empty item is no value (``a,b,``), as an empty variable is."""
    from service.common.settings import SettingsError

    for text in ('served_model_name = ""\n', 'served_model_name = ["a", ""]\n'):
        with pytest.raises(SettingsError, match="--served-model-name .*: is empty; give a name"):
            _resolve_with(tmp_path, text)
    assert _resolve_with(tmp_path, env={"HEADROOM_SERVED_MODEL_NAME": "a,b,"}).served_model_name == ("a", "b")


def test_a_word_or_number_option_refuses_other_toml_values(tmp_path):
    from service.common.settings import SettingsError

    for value in ("nan", "inf", "-inf", "1e400"):  # other float options refuse them; never is -1
        with pytest.raises(SettingsError, match=f"--keep-alive: '{value}' is not a duration"):
            _resolve_with(tmp_path, flags={"keep_alive": value})
    with pytest.raises(SettingsError, match="is not a duration"):
        _resolve_with(tmp_path, "keep_alive = nan\n")

    with pytest.raises(SettingsError, match=r'cpu_experts: true is neither text nor a number \(use a number, or a '
                                            r'word in quotes: cpu_experts = "..."\)'):
        _resolve_with(tmp_path, "cpu_experts = true\n")
    # A value of the wrong kind names what to write: a choice's words, quoted as TOML
    # spells them, and a word option takes them in any case.
    with pytest.raises(SettingsError, match=r'cuda_graphs = 3 is not a valid boolean \(use true/false'):
        _resolve_with(tmp_path, "cuda_graphs = 3\n")
    with pytest.raises(SettingsError, match=r"'16' is not one of auto, f16, fp8, q8_0, q4_0"):
        _resolve_with(tmp_path, "kv_cache_dtype = 16\n")
    assert _resolve_with(tmp_path, 'kv_cache_dtype = "Q8_0"\n').kv_cache_dtype == "q8_0"
    with pytest.raises(SettingsError, match=r'model = 3 is not a valid string \(write it in quotes: model = "..."\)'):
        _resolve_with(tmp_path, "model = 3\n")
    with pytest.raises(SettingsError, match="--cpu-experts: '-1' is not auto, none or a whole number"):
        _resolve_with(tmp_path, flags={"cpu_experts": "-1"})


def test_an_option_error_names_its_flag_once(tmp_path):
    """A bad value from the flag says the flag once; from elsewhere, the flag and where
    the value came from."""
    from service.common.settings import OPTIONS, SettingsError

    for opt in (o for o in OPTIONS if o.choices):
        with pytest.raises(SettingsError) as info:
            _resolve_with(tmp_path, flags={opt.name: "bogus"})
        assert str(info.value).startswith(f"{opt.flag}: 'bogus' is not one of"), info.value
        assert str(info.value).count(opt.flag) == 1
        with pytest.raises(SettingsError) as info:
            _resolve_with(tmp_path, env={opt.env: "bogus"})
        assert str(info.value).startswith(f"{opt.flag} ({opt.env}): ")


@pytest.mark.parametrize(
    ("file_text", "env", "flags"),
    [
        ("", {}, {"quantization": "fp8", "gguf_quantized": True}),
        ("gguf_quantized = true\n", {"HEADROOM_QUANTIZATION": "fp8"}, {}),
    ],
)
def test_fp8_quantization_and_gguf_blocks_are_refused_together(tmp_path, file_text, env, flags):
    """Both choose the weights' format: the pair is refused, naming the fix."""
    from service.common.settings import SettingsError

    with pytest.raises(SettingsError, match="--gguf-quantized .*drop one of the two"):
        _resolve_with(tmp_path, file_text, env, flags)


def test_cpu_experts_above_the_moe_layers_is_refused_naming_the_largest():
    """A number typed is honoured or refused, never cut (engine.core.settings_fit)."""
    from engine.common.config import ModelConfig
    from engine.common.errors import SettingRefused
    from engine.core.settings_fit import check_cpu_experts

    shape = dict(architecture="Qwen3MoeForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=12,
                 num_layers=4, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                 max_position_embeddings=16)
    moe = ModelConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_layers=(1, 2, 3))
    for fine in ("auto", "none", "0", "3"):
        check_cpu_experts(EngineConfig(cpu_experts=fine), moe)
    with pytest.raises(SettingRefused, match="has 3 mixture-of-experts layers; use --cpu-experts 3 or fewer"):
        check_cpu_experts(EngineConfig(cpu_experts="4"), moe)
    dense = ModelConfig(**{**shape, "architecture": "LlamaForCausalLM"})
    with pytest.raises(SettingRefused, match="has no mixture-of-experts layers; use --cpu-experts none"):
        check_cpu_experts(EngineConfig(cpu_experts="1"), dense)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_seconds_option_refuses_a_number_that_is_not_finite(tmp_path, value):
    """--shutdown-timeout inf passed, then the first Ctrl-C crashed the signal handler
    (a Retry-After of infinite seconds) and the service never exited."""
    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    for name, flag in (("shutdown_timeout", "--shutdown-timeout"), ("stall_timeout_s", "--stall-timeout-s")):
        with pytest.raises(SettingsError, match=f"{flag}: {value.lstrip('-')}|{flag}: -inf"):
            resolve({name: float(value)}, env={}, config_path=empty)
    with pytest.raises(SettingsError, match=r"--shutdown-timeout \(HEADROOM_SHUTDOWN_TIMEOUT\): .*not a finite number"):
        resolve({}, env={"HEADROOM_SHUTDOWN_TIMEOUT": value}, config_path=empty)


@pytest.mark.parametrize("key", ["", " "])
def test_an_empty_api_key_is_refused_rather_than_turning_the_check_off(tmp_path, key):
    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(SettingsError, match="--api-key: is empty; unset it"):
        resolve({"api_key": key}, env={}, config_path=empty)
    with pytest.raises(SettingsError, match="HEADROOM_API_KEY.*is empty"):
        resolve({}, env={"HEADROOM_API_KEY": " "}, config_path=empty)
    # An empty variable is an unset one, for every option.
    assert resolve({}, env={"HEADROOM_API_KEY": ""}, config_path=empty).api_key is None
    assert resolve({"api_key": "k"}, env={}, config_path=empty).api_key == "k"


def test_a_missing_config_file_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    """`--config c1.toml` from some folder: the message names the file looked at."""
    from pathlib import Path

    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingsError) as info:
        resolve({}, env={}, config_path=Path("c1.toml"))
    assert str(info.value) == f"config file {tmp_path / 'c1.toml'} does not exist"


# -- the kernel switches (kernels.switches) as options ---------------------------------------


def test_kernel_switches_are_options_of_the_engine():
    """Each field of :class:`kernels.switches.KernelSwitches` is an option of the engine
    (so of serve, generate, plan and bench engine): its name, type, default, help and
    values, the flag and variable from the name; ``HEADROOM_KERNELS`` and
    ``HEADROOM_TP_CUDA_GRAPHS`` keep their names."""
    from kernels.switches import KernelSwitches

    by_name = {o.name: o for o in options_of(EngineConfig)}
    for f in dataclasses.fields(KernelSwitches):
        opt = by_name[f.name]
        assert (opt.default, opt.help, opt.choices) == (f.default, f.metadata["help"], f.metadata["choices"])
        assert opt.type is type(f.default)  # bool, str, or int (a row count)
    assert (by_name["quant_int8"].flag, by_name["quant_int8"].env) == ("--quant-int8", "HEADROOM_QUANT_INT8")
    assert by_name["kernels"].env == "HEADROOM_KERNELS" and by_name["kernels"].choices == ("auto", "torch")
    assert by_name["tp_cuda_graphs"].env == "HEADROOM_TP_CUDA_GRAPHS" and not by_name["tp_cuda_graphs"].default
    rows = by_name["quant_dequant_rows"]
    assert rows.flag == "--quant-dequant-rows" and [check(-1) for check in rows.checks] == ["must be at least 0"]


def test_kernel_switch_flags_and_variables_reach_the_worker(tmp_path):
    """A flag, a variable and a config key of a kernel switch land in the worker's engine
    config as the spawned worker receives it (pickled), and from there in the switches
    the engine hands the kernels."""
    import pickle

    from kernels.switches import KernelSwitches
    from service.common.settings_sources import resolve

    config = tmp_path / "config.toml"
    config.write_text("quant_int8_parts = false\n")
    settings = resolve({"quant_int8": False, "pdl": False},
                       env={"HEADROOM_KERNELS": "torch", "HEADROOM_GEMV": "on"}, config_path=config)
    worker = pickle.loads(pickle.dumps(settings.worker_config()))
    assert pick(worker.engine, KernelSwitches) == KernelSwitches(kernels="torch", pdl=False, gemv=True,
                                                                 quant_int8=False, quant_int8_parts=False)
    assert [settings.sources[n] for n in ("quant_int8", "kernels", "quant_int8_parts", "quant_ptx")] == \
        ["--quant-int8", "HEADROOM_KERNELS", str(config), "default"]


def test_the_engine_hands_its_kernel_switches_to_the_kernels(tmp_path, make_tiny_hf_model):
    """The engine's constructor configures the kernels from its config before it loads
    anything (the worker's and ``headroom generate``'s engine alike)."""
    from engine.core.engine import Engine
    from kernels.switches import KernelSwitches, current, using

    make_tiny_hf_model("qwen3", tmp_path, vocab_size=256)
    wanted = KernelSwitches(kernels="torch", pdl=False, cpu_kernels=False, quant_int8=False)
    with using():  # the process's switches as they were afterwards
        Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=64,
                            **dataclasses.asdict(wanted)))
        assert current() == wanted
