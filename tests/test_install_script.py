"""``installers/install.sh`` in a fresh temporary home: a dedicated venv, headroom from
a copy of this source, the default model, a ``headroom`` link, and the systemd user
unit, offline.

Offline by the script's own options: ``--reuse-site-packages`` points the new venv at
this environment's installed packages (torch, the default model's package and
headroom's dependencies) and ``--pip-arg --no-index --pip-arg --no-build-isolation``
keeps pip off the network. ``systemctl`` is a stand-in first on PATH that records its
arguments (a test never drives the machine's user manager); the unit file is real.
Then the installed ``headroom`` answers a prompt with the default model, and
``headroom service uninstall`` removes the unit.

Slow (a venv, a wheel build and one engine load: about a minute on 2 busy cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from test_packaging import buildable_source

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="the Linux install script"),
]

def run(args: list[str], env: dict[str, str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """``args`` run in ``cwd`` with ``env``, their output captured as text."""
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, **kwargs)


FAKE_SYSTEMCTL = """#!/bin/sh
echo "$*" >> "{log}"
exit 0
"""


def test_install_script_in_a_fresh_home_gives_a_working_headroom(tmp_path, default_model_dir):
    source = buildable_source(tmp_path / "src")
    home = tmp_path / "home"
    home.mkdir()
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    calls = tmp_path / "systemctl.log"
    (fake_bin / "systemctl").write_text(FAKE_SYSTEMCTL.format(log=calls))
    (fake_bin / "systemctl").chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not (k.startswith("HEADROOM_") and k != "HEADROOM_CACHE_DIR")
    }
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        PATH=f"{fake_bin}{os.pathsep}{env['PATH']}",
    )
    script = source / "installers" / "install.sh"
    result = run(
        [
            "bash",
            str(script),
            "--from-source",
            str(source),
            "--python",
            sys.executable,
            "--reuse-site-packages",
            sysconfig.get_paths()["purelib"],
            "--pip-arg",
            "--no-index",
            "--pip-arg",
            "--no-build-isolation",
        ],
        env,
        tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    venv = home / ".local" / "share" / "headroom" / "venv"
    link = home / ".local" / "bin" / "headroom"
    assert link.resolve() == (venv / "bin" / "headroom").resolve()
    assert "headroom 0.1.0" in result.stdout
    assert "no NVIDIA GPU" in result.stdout or "NVIDIA GPU found" in result.stdout
    unit = home / ".config" / "systemd" / "user" / "headroom.service"
    assert f'ExecStart="{venv / "bin" / "headroom"}" "serve"' in unit.read_text()
    recorded = calls.read_text().splitlines()
    assert "--user enable headroom.service" in recorded
    assert "--user restart headroom.service" in recorded

    # Its own code, not this checkout's, and the default model answers.
    where = run([str(venv / "bin" / "python"), "-c", "import service; print(service.__file__)"], env, tmp_path,
                check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv)
    answer = run([str(link), "generate", "--max-tokens", "4", "--temperature", "0", "Say hi."], env, tmp_path,
                 timeout=600)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip(), answer.stderr

    removed = run([str(link), "service", "uninstall"], env, tmp_path, timeout=60)
    assert removed.returncode == 0, removed.stderr
    assert not unit.exists()
    assert "--user disable --now headroom.service" in calls.read_text().splitlines()
