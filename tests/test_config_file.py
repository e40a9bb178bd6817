"""``config.toml`` refusals: a file that is not UTF-8 and a table headroom does not know
are one line naming the file, exit 2, like an unknown key (never a traceback, never
silently ignored)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from service.cli.commands import main
from service.common.settings import SettingsError
from service.common.settings_sources import resolve


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\xff\xfe\n", "is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"),
        (b"[server]\nbogus = 1\n", "unknown table [server]; known: [serve] (or the keys at the top level)"),
        (b"port = 8427\n[serve.extra]\nx = 1\n", "unknown setting 'extra'"),
    ],
)
def test_a_bad_config_file_is_refused_naming_it(tmp_path, content, needle):
    config = tmp_path / "config.toml"
    config.write_bytes(content)
    with pytest.raises(SettingsError) as info:
        resolve({}, env={}, config_path=config)
    assert str(config) in str(info.value) and needle in str(info.value)
    result = CliRunner().invoke(main, ["plan", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_serve_table_and_top_level_keys_are_read(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("port = 9001\n[serve]\nlog_level = 'debug'\n")
    settings = resolve({}, env={}, config_path=config)
    assert (settings.port, settings.log_level) == (9001, "debug")


def test_config_dir_moves_the_config_file(tmp_path):
    """``HEADROOM_CONFIG_DIR`` moves ``config.toml`` with the token, as docs/configuration.md
    says; ``HEADROOM_CONFIG`` still names another file."""
    (tmp_path / "config.toml").write_text("port = 9002\n")
    assert resolve({}, env={"HEADROOM_CONFIG_DIR": str(tmp_path)}).port == 9002
    other = tmp_path / "other.toml"
    other.write_text("port = 9003\n")
    env = {"HEADROOM_CONFIG_DIR": str(tmp_path), "HEADROOM_CONFIG": str(other)}
    assert resolve({}, env=env).port == 9003


@pytest.mark.parametrize(("content", "needle"), [
    ("port = 9001\n[serve]\nport = 9002\n", "port is set twice, as port in the top level and as port in [serve]"),
    ("max-model-len = 512\nmax_model_len = 1024\n",
     "max_model_len is set twice, as max-model-len in the top level and as max_model_len in the top level"),
])
def test_a_setting_written_twice_is_refused_naming_both_places(tmp_path, content, needle):
    """The file does not say which of two values it means: neither the top level nor
    ``[serve]`` silently wins."""
    config = tmp_path / "config.toml"
    config.write_text(content)
    with pytest.raises(SettingsError) as info:
        resolve({}, env={}, config_path=config)
    assert str(info.value) == f"config file {config}: {needle}; keep one of them"


@pytest.mark.parametrize(("source", "needle"), [("file", "(config.toml)"), ("env", "(HEADROOM_PORT)")])
def test_a_bad_value_is_refused_even_where_a_flag_overrides_it(tmp_path, source, needle):
    config = tmp_path / "config.toml"
    config.write_text("port = 70000\n" if source == "file" else "")
    env = {"HEADROOM_PORT": "70000"} if source == "env" else {}
    with pytest.raises(SettingsError) as info:
        resolve({"port": 8951}, env=env, config_path=config)
    assert str(info.value).startswith("--port (") and needle.strip("()") in str(info.value)
    assert "65535" in str(info.value)
    if source == "file":
        result = CliRunner().invoke(main, ["serve", "--config", str(config), "--port", "8951"])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(f"headroom: error: --port ({config}): ")
        assert len(result.stderr.strip().splitlines()) == 1 and "listening" not in result.output
