"""``headroom service``'s definitions and their install/uninstall, on any OS.

The rendered systemd unit goes through ``systemd-analyze verify``, the LaunchAgent
through plistlib, the Task Scheduler XML through ElementTree, each with paths holding
spaces, quotes, ``%`` and ``$``. Install and uninstall write and remove the real files
in a temporary home (the XDG folders inside it); the OS tools (systemctl, launchctl,
schtasks) are not run: a :class:`RecordingRunner` answers for them and keeps the
commands, which the tests check.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import fake_systemctl

from service.autostart.definitions import (
    LAUNCHD_LABEL,
    ServiceSpec,
    default_spec,
    render_launchd,
    render_systemd,
    render_task,
)
from service.autostart.manager import (
    Runner,
    ServiceError,
    SystemdManager,
    manager_for,
)
from service.cli.commands import main

TASK_NS = {"t": "http://schemas.microsoft.com/windows/2004/02/mit/task"}


class RecordingRunner(Runner):
    """Answers every command with ``returncode`` (or ``codes[argv[1]]``) and keeps it."""

    def __init__(self, returncode: int = 0, stderr: str = "", codes: dict | None = None):
        super().__init__()
        self.calls: list[list[str]] = []
        self.returncode, self.stderr, self.codes = returncode, stderr, codes or {}

    def run(self, argv):
        self.calls.append(list(argv))
        code = self.codes.get(argv[1] if argv[0] == "launchctl" else argv[-1], self.returncode)
        return subprocess.CompletedProcess(list(argv), code, "", self.stderr if code else "")

    def attach(self, argv):
        self.calls.append(list(argv))
        return self.returncode


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty home with the XDG folders inside it and no HEADROOM_* overrides."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var, sub in (
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_DATA_HOME", ".local/share"),
        ("XDG_STATE_HOME", ".local/state"),
        ("XDG_CACHE_HOME", ".cache"),
    ):
        monkeypatch.setenv(var, str(home / sub))
    for var in (
        "HEADROOM_CONFIG",
        "HEADROOM_CONFIG_DIR",
        "HEADROOM_LOG_DIR",
        "HEADROOM_RUNTIME_DIR",
    ):
        monkeypatch.delenv(var, raising=False)
    return home


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def odd_spec(tmp_path: Path) -> ServiceSpec:
    """A spec whose program exists (systemd-analyze checks it) in a folder with a space,
    and whose arguments and environment hold characters each format must escape."""
    program = tmp_path / "my venv" / "bin" / "headroom"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    return ServiceSpec(
        command=(str(program), "serve", "--reserve", "5%", "--model", '/m/a $HOME & <b> "q"'),
        environment=(("HEADROOM_CONFIG", "/c 100%/$x's.toml"),),
        log_dir=tmp_path / "logs",
    )


def systemd_words(line: str) -> list[str]:
    """ExecStart's words as systemd reads these (quoted, C-escaped, %% and $$)."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line)]


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    spec = odd_spec(tmp_path)
    unit = tmp_path / "headroom.service"
    unit.write_text(render_systemd(spec))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + unit.read_text()
    assert result.stderr.strip() == "", result.stderr
    lines = unit.read_text().splitlines()
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert systemd_words(exec_start.removeprefix("ExecStart=")) == list(spec.command)
    env = [line for line in lines if line.startswith("Environment=")]
    # Environment= has %-specifiers but no $ expansion: only % is doubled there.
    assert env[-1] == 'Environment="HEADROOM_CONFIG=/c 100%%/$x\'s.toml"'
    # The check is real: the same unit with a program that does not exist fails it.
    bad = tmp_path / "bad.service"
    bad.write_text(unit.read_text().replace(str(spec.command[0]), "/nonexistent/headroom"))
    result = subprocess.run([analyze, "verify", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "nonexistent" in result.stderr


def test_launchd_plist_round_trips_through_plistlib(tmp_path):
    spec = odd_spec(tmp_path)
    data = render_launchd(spec).encode()
    plist = plistlib.loads(data)
    assert plist["Label"] == LAUNCHD_LABEL
    assert plist["ProgramArguments"] == list(spec.command)
    assert plist["EnvironmentVariables"] == {
        "PYTHONUNBUFFERED": "1",
        "HEADROOM_CONFIG": "/c 100%/$x's.toml",
    }
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["StandardErrorPath"] == str(spec.log_dir / "launchd.log")
    assert plistlib.loads(plistlib.dumps(plist)) == plist


def test_task_xml_parses_with_its_required_elements(tmp_path):
    spec = ServiceSpec(
        command=(
            r"C:\Users\A B\headroom\venv\Scripts\pythonw.exe",
            "-m",
            "service.cli",
            "serve",
            "--model",
            r"C:\models\m & <n>.gguf",
        ),
        environment=(),
        log_dir=tmp_path,
    )
    data = render_task(spec, r"PC\a b").encode("utf-16")  # as TaskManager writes it
    root = ET.fromstring(data)
    assert root.tag == f"{{{TASK_NS['t']}}}Task"
    assert root.findtext("t:RegistrationInfo/t:URI", namespaces=TASK_NS) == r"\headroom"
    assert root.findtext("t:Triggers/t:LogonTrigger/t:UserId", namespaces=TASK_NS) == r"PC\a b"
    assert root.findtext("t:Triggers/t:LogonTrigger/t:Enabled", namespaces=TASK_NS) == "true"
    principal = root.find("t:Principals/t:Principal", TASK_NS)
    assert principal.findtext("t:LogonType", namespaces=TASK_NS) == "InteractiveToken"
    assert principal.findtext("t:RunLevel", namespaces=TASK_NS) == "LeastPrivilege"
    settings = root.find("t:Settings", TASK_NS)
    assert settings.findtext("t:ExecutionTimeLimit", namespaces=TASK_NS) == "PT0S"
    assert settings.findtext("t:MultipleInstancesPolicy", namespaces=TASK_NS) == "IgnoreNew"
    exec_ = root.find("t:Actions/t:Exec", TASK_NS)
    assert exec_.findtext("t:Command", namespaces=TASK_NS) == spec.command[0]
    assert exec_.findtext("t:Arguments", namespaces=TASK_NS) == (
        r'-m service.cli serve --model "C:\models\m & <n>.gguf"'
    )


@pytest.mark.parametrize("platform", ["linux", "darwin", "win32"])
def test_install_twice_then_uninstall_leaves_nothing_behind(home, platform):
    before = tree(home)
    runner = RecordingRunner(codes={"print": 1})  # launchd: not loaded yet
    manager = manager_for(platform, runner)
    assert home in manager.path.parents

    first = manager.install()
    assert first[0] == f"wrote: {manager.path}"
    assert manager.path.read_bytes() == manager.render()
    second = manager.install()  # idempotent: same file, nothing rewritten
    assert second[0] == f"unchanged: {manager.path}"
    assert manager.is_installed()
    if platform == "linux":
        unit = manager.path.name
        assert ["systemctl", "--user", "enable", unit] in runner.calls
        assert ["systemctl", "--user", "restart", unit] in runner.calls  # the new unit runs
        assert runner.calls[-1] == ["systemctl", "--user", "start", unit]  # unchanged: start
    elif platform == "darwin":
        assert any(
            c[:2] == ["launchctl", "bootstrap"] and c[-1] == str(manager.path) for c in runner.calls
        )
    else:
        assert [
            "schtasks",
            "/Create",
            "/TN",
            "headroom",
            "/XML",
            str(manager.path),
            "/F",
        ] in runner.calls
        assert manager.path.read_bytes()[:2] == b"\xff\xfe"  # UTF-16, as schtasks reads it

    runner.calls.clear()
    lines = manager.uninstall()
    assert f"removed: {manager.path}" in lines
    assert tree(home) == before
    if platform == "linux":
        assert ["systemctl", "--user", "disable", "--now", manager.path.name] in runner.calls
    again = manager.uninstall()  # nothing left to undo: no error
    if platform == "linux":
        assert again == ["not installed: nothing to remove"]
    assert tree(home) == before


def test_uninstall_removes_the_enablement_without_a_user_manager(home):
    """A unit enabled in a session that is gone: its wants link goes with it."""
    manager = manager_for("linux", RecordingRunner())
    manager.install(start=False)
    link = manager.path.parent / "default.target.wants" / manager.path.name
    link.parent.mkdir()
    link.symlink_to(manager.path)  # what `systemctl --user enable` made
    manager.runner = RecordingRunner(returncode=1, stderr="Failed to connect to bus")
    lines = manager.uninstall()
    assert f"removed: {link}" in lines and f"removed: {manager.path}" in lines
    assert tree(home) == set()


@pytest.mark.parametrize(
    ("returncode", "stderr", "expected"),
    [
        (1, "Failed to connect to bus: No medium found", "loginctl enable-linger"),
        (127, "", "systemctl is not installed"),
    ],
)
def test_without_user_systemd_the_error_names_the_fix(home, returncode, stderr, expected):
    manager = manager_for("linux", RecordingRunner(returncode=returncode, stderr=stderr))
    assert isinstance(manager, SystemdManager)
    with pytest.raises(ServiceError, match=expected) as info:
        manager.install()
    # Refused before anything is written: no unit file for doctor to take as installed.
    assert str(manager.path) in str(info.value) and "nothing was written" in str(info.value)
    assert not manager.path.exists() and tree(home) == set()
    for action in (manager.start, manager.stop, manager.status, lambda: manager.logs(5, False)):
        with pytest.raises(ServiceError, match=expected):
            action()
    manager.uninstall()
    assert tree(home) == set()


@pytest.mark.skipif(sys.platform != "linux", reason="the systemd user unit is Linux's")
def test_status_and_doctor_without_user_systemd_say_so_and_name_the_fix(home, monkeypatch, tmp_path):
    """`service status` and doctor ask for the user instance before looking for the
    unit: "not installed" would send the user to an install that cannot work either."""
    from service.doctor import WARN, Context, _check_service

    bus = "Failed to connect to bus: No medium found"
    monkeypatch.setenv("PATH", fake_systemctl(tmp_path / "bin", 1, bus))
    result = CliRunner().invoke(main, ["service", "status"])
    assert result.exit_code != 0
    assert "no systemd user instance" in result.output and bus in result.output
    assert "loginctl enable-linger" in result.output and "service install" not in result.output
    check = _check_service(Context())
    assert check.status == WARN and "not installed" in check.detail
    assert "no systemd user instance" in check.detail and "loginctl enable-linger" in check.fix

    manager_for("linux", RecordingRunner()).install(start=False)  # installed, no instance
    check = _check_service(Context())
    assert check.status == WARN and bus in check.detail
    assert "no service manager confirms" in check.detail and "installed at" not in check.detail

    monkeypatch.setenv("PATH", fake_systemctl(tmp_path / "bin", 0))  # an instance answers
    assert _check_service(Context()).status == "OK"


def test_the_spec_runs_this_installation_and_passes_moved_folders(home, monkeypatch, tmp_path):
    monkeypatch.setenv("HEADROOM_CONFIG_DIR", str(tmp_path / "cfg"))
    linux, mac = default_spec("linux"), default_spec("darwin")
    assert Path(linux.command[0]).is_absolute() and "serve" in linux.command
    assert "--log-file" not in linux.command  # the journal
    assert mac.command[-2:] == ("--log-file", "auto")
    assert ("HEADROOM_CONFIG_DIR", str(tmp_path / "cfg")) in linux.environment
    assert default_spec("win32").command[1:4] == ("-m", "service.cli", "serve")
    with pytest.raises(ValueError, match="Linux .* macOS .* Windows"):
        default_spec("sunos5")


def test_help_alias_and_version():
    runner = CliRunner()
    short, long = runner.invoke(main, ["-h"]), runner.invoke(main, ["--help"])
    assert short.exit_code == 0 and short.output == long.output
    assert "service" in short.output and "doctor" in short.output
    assert runner.invoke(main, ["service", "-h"]).exit_code == 0
    version = runner.invoke(main, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("headroom ")


def test_logs_show_the_tail_of_the_rotated_file_on_macos_and_windows(home, capsys):
    manager = manager_for("darwin", RecordingRunner())
    with pytest.raises(ServiceError, match="no log yet"):
        manager.logs(2, False)
    manager.log_file().parent.mkdir(parents=True)
    manager.log_file().write_text("one\ntwo\nthree\n")
    assert manager.logs(2, False) == 0
    assert capsys.readouterr().out == "two\nthree\n"
    assert manager.log_file().parent == manager.spec.log_dir


@pytest.mark.parametrize("failing", ["daemon-reload", "enable", "restart"])
def test_a_failed_install_leaves_nothing_half_done(home, failing):
    """A step of the manager's that fails puts everything back: no unit file for doctor
    to take as installed, no folder made for it, the enablement undone."""
    before = tree(home)
    runner = RecordingRunner()
    real_run = runner.run

    def run(argv):
        result = real_run(argv)
        return subprocess.CompletedProcess(argv, 1, "", "boom") if failing in argv else result

    runner.run = run
    manager = manager_for("linux", runner)
    with pytest.raises(ServiceError, match="boom") as info:
        manager.install()
    assert "as it was before" in str(info.value)
    assert tree(home) == before
    if failing != "daemon-reload":
        assert ["systemctl", "--user", "disable", "--now", manager.path.name] in runner.calls

    # An install over an older unit puts the older text back.
    manager.runner = RecordingRunner()
    manager.install()
    manager.path.write_bytes(b"[Unit]\nDescription=older\n")
    manager.runner = runner
    with pytest.raises(ServiceError):
        manager.install()
    assert manager.path.read_bytes() == b"[Unit]\nDescription=older\n"


@pytest.mark.skipif(sys.platform != "linux", reason="the systemd user unit is Linux's")
def test_doctor_asks_the_user_manager_whether_the_unit_is_enabled(home, monkeypatch, tmp_path):
    from service.doctor import WARN, Context, _check_service

    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "systemctl"
    # An instance answers, and the unit is not enabled (the file alone was left).
    script.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = is-enabled ] && exit 1; done\nexit 0\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    manager_for("linux", RecordingRunner()).install(start=False)
    check = _check_service(Context())
    assert check.status == WARN and "not enabled" in check.detail and "service install" in check.fix
