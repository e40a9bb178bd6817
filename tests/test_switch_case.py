"""The kernel switches' text values are words in any case, as sizes (``6gib``) and bool
switches (``ON``) are: ``--expert-cpu-share AUTO`` was refused. Every text switch of
:class:`kernels.switches.KernelSwitches`, from the flag, the environment and
config.toml, is taken and held in lower case; a word it does not take is still refused
naming the values it takes. The benchmarks' reader of the switches' variables
(:func:`engine.common.environment.kernel_switches`) reads them by the same rule, and
takes the count switches it refused whatever their value."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine.common.config import KernelOptions
from engine.common.environment import kernel_switches
from engine.common.options import options_of
from service.cli.commands import main
from service.common.settings_sources import resolve

TEXT_SWITCHES = [opt for opt in options_of(KernelOptions) if opt.choices]


def _sources(opt, written: str) -> list[dict]:
    return [{"flags": {opt.name: written}}, {"env": {opt.env: written}},
            {"config": f"{opt.name} = {written!r}\n".replace("'", '"')}]


@pytest.mark.parametrize("opt", TEXT_SWITCHES, ids=lambda opt: opt.name)
def test_every_text_switch_takes_its_words_in_any_case_from_every_source(tmp_path, opt):
    path = tmp_path / "config.toml"
    for choice in opt.choices:
        for written in (choice.upper(), choice.capitalize()):
            for source in _sources(opt, written):
                path.write_text(source.get("config", ""))
                settings = resolve(source.get("flags", {}), env=source.get("env", {}), config_path=path)
                assert getattr(settings, opt.name) == choice, (source, getattr(settings, opt.name))
        if choice.isdecimal():  # TOML's number for a numeral word
            path.write_text(f"{opt.name} = {choice}\n")
            assert getattr(resolve({}, env={}, config_path=path), opt.name) == choice


def test_the_cli_takes_a_switch_in_capitals_and_refuses_a_word_it_does_not_take(tmp_path, default_model_dir):
    config = tmp_path / "config.toml"
    config.write_text('kernels = "TORCH"\n')
    plan = ["plan", "--device-total", "6GiB", "--json", "--no-cpu-kernels"]  # no C build: only the words count here
    taken = CliRunner().invoke(main, [*plan, "--expert-cpu-share", "AUTO", "--cpu-kquant-act-bits", "8"],
                               env={"HEADROOM_CONFIG": str(config), "HEADROOM_EXPERT_CPU_SHARE": "Off"})
    assert taken.exit_code == 0, taken.output
    refused = CliRunner().invoke(main, [*plan, "--expert-cpu-share", "Sometimes"],
                                 env={"HEADROOM_CONFIG": str(config)})
    assert refused.exit_code == 2, refused.output
    assert "--expert-cpu-share" in refused.stderr and "'Sometimes' is not one of auto, off" in refused.stderr, refused.stderr


def test_the_benchmarks_reader_of_the_variables_takes_words_in_any_case_and_counts():
    for opt in TEXT_SWITCHES:
        for choice in opt.choices:
            assert getattr(kernel_switches({opt.env: choice.upper()}), opt.name) == choice
    assert kernel_switches({"HEADROOM_QUANT_GEMV_ROWS": "16"}).quant_gemv_rows == 16
    with pytest.raises(ValueError, match=r"HEADROOM_QUANT_GEMV_ROWS='-3' is not a value of --quant-gemv-rows: use a "
                                         r"whole number, or unset it"):
        kernel_switches({"HEADROOM_QUANT_GEMV_ROWS": "-3"})
    with pytest.raises(ValueError, match=r"HEADROOM_EXPERT_CPU_SHARE='Sometimes' is not a value of --expert-cpu-share: "
                                         r"use auto, off, or unset it"):
        kernel_switches({"HEADROOM_EXPERT_CPU_SHARE": "Sometimes"})
