"""The service definitions, rendered from the templates of ``installers/templates``
(:func:`service.common.resources.data_dir`), with the values of one :class:`ServiceSpec`:

- Linux: a systemd user unit, ``headroom.service`` (its log: the user journal).
- macOS: a launchd LaunchAgent, ``<label>.plist`` (log: ``--log-file``, rotated).
- Windows: a Task Scheduler logon task, ``headroom-task.xml`` in UTF-16 as ``schtasks
  /Create /XML`` reads it (log: ``--log-file``, rotated).

Each format escapes its values its own way (systemd's quoting and ``%`` specifiers, XML
entities), so a path with spaces, quotes or ``%`` survives.
"""

from __future__ import annotations

import string
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from engine.common.environment import CONFIG
from engine.common.environment import variables as headroom_variables
from service.common.paths import CONFIG_DIR_ENV, LOG_DIR_ENV, RUNTIME_DIR_ENV, log_dir
from service.common.resources import data_dir

SERVICE_NAME = "headroom"
SYSTEMD_UNIT = "headroom.service"
LAUNCHD_LABEL = "io.headroom.serve"
TASK_NAME = "headroom"
TEMPLATES = {"linux": "headroom.service", "darwin": "headroom.plist", "win32": "headroom-task.xml"}
# Settings the installing shell moved elsewhere, passed on to the service so that it
# uses the same config, token and folders (Linux and macOS; a task has no environment).
PASSED_ENV = (CONFIG.name, CONFIG_DIR_ENV, LOG_DIR_ENV, RUNTIME_DIR_ENV)


def platform_key(platform: str | None = None) -> str:
    """``linux``, ``darwin`` or ``win32`` for ``platform`` (default ``sys.platform``).

    Raises:
        ValueError: another platform, naming the supported ones.
    """
    platform = platform or sys.platform
    for key in TEMPLATES:
        if platform.startswith(key):
            return key
    raise ValueError(
        f"no service definition for {platform!r}: headroom installs a service on Linux "
        "(systemd), macOS (launchd) and Windows (Task Scheduler); run `headroom serve` instead"
    )


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: ``command`` (argv, absolute program first), extra
    ``environment`` pairs, and ``log_dir`` for the files the OS writes for it."""

    command: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    log_dir: Path


def headroom_command(platform: str) -> tuple[str, ...]:
    """The argv that runs ``headroom serve`` from this installation: the console
    script next to this interpreter (the venv's own), else ``python -m service.cli``;
    on Windows ``pythonw.exe`` so that no console window opens at logon."""
    bin_dir = Path(sys.executable).parent
    if platform == "win32":
        pythonw = bin_dir / "pythonw.exe"
        python = pythonw if pythonw.exists() else Path(sys.executable)
        return (str(python), "-m", "service.cli", "serve")
    script = bin_dir / "headroom"
    if script.exists():
        return (str(script), "serve")
    return (sys.executable, "-m", "service.cli", "serve")


def default_spec(platform: str | None = None) -> ServiceSpec:
    """The spec for this installation on ``platform``: logs in the journal on Linux, in
    ``<user log dir>/headroom.log`` (``--log-file auto``) elsewhere."""
    key = platform_key(platform)
    command = headroom_command(key)
    if key != "linux":
        command = (*command, "--log-file", "auto")
    ours = headroom_variables()
    environment = tuple((k, ours[k]) for k in PASSED_ENV if ours.get(k))
    return ServiceSpec(command=command, environment=environment, log_dir=log_dir())


def _template(key: str) -> string.Template:
    path = data_dir("templates") / TEMPLATES[key]
    try:
        return string.Template(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FileNotFoundError(
            f"the service template {path} is missing ({exc.strerror}): headroom is "
            "installed incompletely; reinstall it"
        ) from None


def _systemd_quote(arg: str, *, command: bool = True) -> str:
    """One argument of ExecStart (``command``) or Environment=: double-quoted with C
    escapes and ``%`` doubled (a specifier otherwise); in a command line ``$`` is
    doubled too (a variable otherwise), in Environment= it is plain. Sources:
    systemd.service(5) "Command lines", systemd.exec(5) "Environment=", systemd.unit(5)
    "Specifiers"."""
    text = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if command:
        text = text.replace("$", "$$")
    return f'"{text}"'


def render_systemd(spec: ServiceSpec) -> str:
    """The systemd user unit's text."""
    env_lines = [
        "Environment=" + _systemd_quote(f"{k}={v}", command=False)
        for k, v in (("PYTHONUNBUFFERED", "1"), *spec.environment)
    ]
    return _template("linux").substitute(
        exec_start=" ".join(_systemd_quote(a) for a in spec.command),
        environment="\n".join(env_lines),
    )


def render_launchd(spec: ServiceSpec, label: str = LAUNCHD_LABEL) -> str:
    """The LaunchAgent plist's text."""

    def string_el(value: str) -> str:
        return f"\t\t<string>{escape(value)}</string>"

    env = [("PYTHONUNBUFFERED", "1"), *spec.environment]
    return _template("darwin").substitute(
        label=escape(label),
        program_arguments="\n".join(string_el(a) for a in spec.command),
        environment="\n".join(f"\t\t<key>{escape(k)}</key>\n{string_el(v)}" for k, v in env),
        stderr_path=escape(str(spec.log_dir / "launchd.log")),
    )


def _windows_quote(arg: str) -> str:
    """One argument as CommandLineToArgvW reads it (quotes only where needed)."""
    import subprocess

    return subprocess.list2cmdline([arg])


def render_task(spec: ServiceSpec, user_id: str, task_name: str = TASK_NAME) -> str:
    """The Task Scheduler XML's text (encode it as UTF-16 to write it)."""
    return _template("win32").substitute(
        task_name=escape(task_name),
        user_id=escape(user_id),
        command=escape(spec.command[0]),
        arguments=escape(" ".join(_windows_quote(a) for a in spec.command[1:])),
    )
