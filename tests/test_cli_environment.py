"""``HEADROOM_*`` variables headroom does not read, warned of as a command starts."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from service.cli.commands import main


def test_a_misspelled_variable_is_warned_of_once_naming_the_closest(tmp_path):
    """``HEADROOM_PORTT`` is not silently ignored: one warning line each, naming the
    variable meant; the command still runs. Variables other tools read (the tests' own)
    and the settings that are only variables are not warned of."""
    env = {"HEADROOM_CONFIG": os.devnull, "HEADROOM_PORTT": "1", "HEADROOM_ZZQX": "1",
           "HEADROOM_FAKE_STEP_S": "1", "HEADROOM_FUZZ_CASES": "2", "HEADROOM_CONFIG_DIR": str(tmp_path)}
    result = CliRunner().invoke(main, ["models", "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "headroom: warning: HEADROOM_PORTT is not a variable headroom reads (did you mean HEADROOM_PORT?); ignored",
        "headroom: warning: HEADROOM_ZZQX is not a variable headroom reads (`headroom serve --help` lists the "
        "variables); ignored",
    ]
    json.loads(result.stdout)
