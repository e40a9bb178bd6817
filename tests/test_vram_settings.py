"""The VRAM watcher's and the replan's settings (flags, environment, their checks), the
help that documents them, and ``headroom token``.
"""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from engine.common.units import MiB
from service.common.settings import SettingsError
from service.common.settings_sources import resolve


def test_vram_and_replan_settings(tmp_path):
    config = tmp_path / "c.toml"
    config.touch()
    s = resolve({}, env={}, config_path=config)
    assert (s.vram_source, s.vram_hz, s.replan_hold) == ("nvml", 4.0, 10.0)
    assert s.replan_low is None and s.replan_high is None
    s = resolve(
        {"vram_source": "simulated", "device_total": "4GiB", "replan_low": "64MiB"},
        env={"HEADROOM_REPLAN_HIGH": "512MiB"},
        config_path=config,
    )
    assert (s.replan_low, s.replan_high) == (64 * MiB, 512 * MiB)
    for flags, message in (
        ({"vram_source": "gpu"}, "not one of nvml, simulated"),
        ({"vram_source": "simulated"}, "needs --device-total"),
        ({"vram_timeline": "t.json"}, "needs --vram-source simulated"),
        ({"vram_hz": 0.0}, "must be positive"),
        ({"replan_low": "1GiB", "replan_high": "512MiB"}, "above --replan-low"),
    ):
        with pytest.raises(SettingsError, match=message):
            resolve(flags, env={}, config_path=config)


def test_serve_help_documents_the_vram_options():
    from service.cli.commands import main

    out = CliRunner().invoke(main, ["serve", "--help"], env={"HEADROOM_CONFIG": os.devnull}).output
    for flag in ("--vram-source", "--vram-timeline", "--vram-hz", "--replan-low", "--replan-high"):
        assert flag in out
    assert "HEADROOM_REPLAN_HOLD" in out


def test_headroom_token_prints_the_file_and_the_dashboard_address(tmp_path):
    from service.cli.commands import main

    env = {"HEADROOM_CONFIG": os.devnull, "HEADROOM_CONFIG_DIR": str(tmp_path / "cfg")}
    result = CliRunner().invoke(main, ["token", "--port", "9123"], env=env)
    assert result.exit_code == 0, result.output
    token = (tmp_path / "cfg" / "token").read_text().strip()
    assert f"token file: {tmp_path / 'cfg' / 'token'}" in result.output
    assert f"http://127.0.0.1:9123/ui/#token={token}" in result.output
    assert "?token=" not in result.output  # a fragment never reaches the server
    assert stat.S_IMODE((tmp_path / "cfg" / "token").stat().st_mode) == 0o600
    # The same token the next time.
    again = CliRunner().invoke(main, ["token"], env=env)
    assert f"#token={token}" in again.output
