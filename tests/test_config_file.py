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
