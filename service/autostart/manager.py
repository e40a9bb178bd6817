"""Install, remove, start, stop and inspect the login service, per OS.

:func:`manager_for` gives the manager of a platform; each writes its definition
(:mod:`service.autostart.definitions`) as a real file and drives the OS's own tool
through a :class:`Runner`: ``systemctl --user`` / ``journalctl --user`` (Linux),
``launchctl`` (macOS), ``schtasks`` (Windows). Tests pass a runner that records the
commands instead of running them.

Every operation is idempotent: install twice leaves one service (rewritten only when its
text changed, restarted only then), uninstall undoes everything install did (the
definition, the enablement, the folders install made while they are empty) and succeeds
when there is nothing to undo. Logs the service wrote are the user's and are kept.

Errors are :class:`ServiceError` with a message naming the fix.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from service.autostart.definitions import (
    LAUNCHD_LABEL,
    SYSTEMD_UNIT,
    TASK_NAME,
    ServiceSpec,
    default_spec,
    platform_key,
    render_launchd,
    render_systemd,
    render_task,
)
from service.autostart.files import first_missing, remove_empty_dirs, restore, write_if_changed
from service.common.paths import APP_NAME

LOG_FILE_NAME = "headroom.log"


class ServiceError(Exception):
    """An operation on the service failed; the message says why and what fixes it."""


@dataclass(frozen=True)
class ManagerProblem:
    """Why the OS's service manager cannot be reached (``what``) and what fixes it
    (``fix``); as text, both."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}"


@dataclass
class Runner:
    """Runs the OS's service tools. :meth:`run` captures the output; :meth:`attach`
    lets it reach the terminal (``status``, ``logs --follow``) and returns the exit code.
    A missing program is exit code 127 with a message, as a shell would say."""

    timeout_s: float = 60.0

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                list(argv), capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except FileNotFoundError:
            return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: not found")

    def attach(self, argv: Sequence[str]) -> int:
        try:
            return subprocess.call(list(argv))
        except FileNotFoundError:
            raise ServiceError(f"{argv[0]} not found") from None


@dataclass
class Manager:
    """The common part: one definition file at :attr:`path`, a log folder for the OSes
    whose service logs to a file, and the runner."""

    spec: ServiceSpec
    runner: Runner = field(default_factory=Runner)

    name = "service"
    logs_to_file = True

    @property
    def path(self) -> Path:
        raise NotImplementedError

    def render(self) -> bytes:
        raise NotImplementedError

    # Each OS's own steps.
    def _register(self, changed: bool, start: bool) -> list[str]:
        raise NotImplementedError

    def _unregister(self) -> list[str]:
        raise NotImplementedError

    def _forget(self) -> None:
        """After the definition is removed (the OS may cache it)."""

    def start(self) -> list[str]:
        raise NotImplementedError

    def stop(self) -> list[str]:
        raise NotImplementedError

    def status(self) -> int:
        raise NotImplementedError

    def is_installed(self) -> bool:
        return self.path.exists()

    def user_manager_problem(self) -> ManagerProblem | None:
        """Why the OS's service manager cannot be reached now, or None (it can, or
        this OS needs no check)."""
        return None

    def install(self, start: bool = True) -> list[str]:
        """Write the definition and register it with the OS (and start it unless
        ``start`` is False); returns what was done, one line each.

        Raises:
            ServiceError: the OS's service manager cannot be reached, or its tool
                failed or is missing; nothing is left half-done: the definition is put
                back as it was (removed when it was new, with the folders made for it)
                and a new one unregistered.
        """
        problem = self.user_manager_problem()
        if problem is not None:
            raise ServiceError(f"cannot install {self.path}: {problem}; nothing was written")
        before = self.path.read_bytes() if self.path.exists() else None
        made = first_missing(self.path.parent)
        log_made = first_missing(self.spec.log_dir) if self.logs_to_file else None
        if self.logs_to_file:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        changed = write_if_changed(self.path, self.render())
        lines = [f"{'wrote' if changed else 'unchanged'}: {self.path}"]
        try:
            return lines + self._register(changed, start)
        except ServiceError as exc:
            if before is None:
                try:
                    self._unregister()
                except (ServiceError, OSError):
                    pass  # undone as far as the manager lets it
            restore(self.path, before, made)
            if log_made is not None:
                remove_empty_dirs(self.spec.log_dir, log_made.parent)
            raise ServiceError(f"{exc} ({self.path} is as it was before)") from None

    def uninstall(self) -> list[str]:
        """Stop and unregister the service, remove its definition and the folders
        install made that are now empty. Succeeds when nothing was installed."""
        lines = self._unregister()
        if self.path.exists():
            self.path.unlink()
            lines.append(f"removed: {self.path}")
        self._forget()
        remove_empty_dirs(self.path.parent, Path.home())
        if self.logs_to_file:
            remove_empty_dirs(self.spec.log_dir, Path.home())
        if not lines:
            lines.append("not installed: nothing to remove")
        return lines

    def log_file(self) -> Path:
        return self.spec.log_dir / LOG_FILE_NAME

    def logs(self, lines: int, follow: bool) -> int:
        """Print the last ``lines`` lines of the service's log, then (``follow``) what
        is appended until Ctrl-C. Returns the exit code."""
        path = self.log_file()
        if not path.exists():
            raise ServiceError(
                f"no log yet at {path}: the service writes it once it has started "
                "(`headroom service start`)"
            )
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f.readlines()[-lines:] if lines > 0 else []:
                print(line, end="")
            if not follow:
                return 0
            try:
                while True:
                    line = f.readline()
                    if line:
                        print(line, end="", flush=True)
                    else:
                        time.sleep(0.5)
            except KeyboardInterrupt:
                return 0

    def _check(self, argv: Sequence[str], fix: str) -> subprocess.CompletedProcess[str]:
        result = self.runner.run(argv)
        if result.returncode != 0:
            why = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
            raise ServiceError(f"`{' '.join(argv)}` failed: {why}; {fix}")
        return result


@dataclass
class SystemdManager(Manager):
    """A systemd user unit in ``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/...``);
    its log is the user journal."""

    name = "systemd user unit"
    logs_to_file = False

    @property
    def path(self) -> Path:
        return Path(platformdirs.user_config_dir()) / "systemd" / "user" / SYSTEMD_UNIT

    def render(self) -> bytes:
        return render_systemd(self.spec).encode()

    def _systemctl(self, *args: str) -> list[str]:
        return ["systemctl", "--user", *args]

    def user_manager_problem(self) -> ManagerProblem | None:
        """Why ``systemctl --user`` cannot work here (with the fix), or None."""
        result = self.runner.run(self._systemctl("show-environment"))
        if result.returncode == 0:
            return None
        if result.returncode == 127:
            return ManagerProblem(
                "systemctl is not installed: this system does not run systemd",
                "start `headroom serve` from your desktop's autostart instead",
            )
        why = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        return ManagerProblem(
            f"there is no systemd user instance to talk to ({why})",
            "log in through a session that starts one (a desktop or SSH login with "
            "pam_systemd, which sets XDG_RUNTIME_DIR), or keep one running without a login "
            "with `sudo loginctl enable-linger $USER`; or run `headroom serve` directly",
        )

    def _require_manager(self, what: str) -> None:
        problem = self.user_manager_problem()
        if problem is not None:
            raise ServiceError(f"cannot {what}: {problem}")

    def _register(self, changed: bool, start: bool) -> list[str]:
        self._require_manager(f"enable {self.path}")
        fix = "see `journalctl --user -xe`"
        self._check(self._systemctl("daemon-reload"), fix)
        self._check(self._systemctl("enable", SYSTEMD_UNIT), fix)
        lines = [f"enabled at login: {SYSTEMD_UNIT}"]
        if start:
            # A changed unit restarts so that the new definition runs; an unchanged one
            # that already runs is left alone.
            self._check(self._systemctl("restart" if changed else "start", SYSTEMD_UNIT), fix)
            lines.append(f"started: {SYSTEMD_UNIT}")
        return lines

    def _wants_link(self) -> Path:
        return self.path.parent / "default.target.wants" / SYSTEMD_UNIT

    def _unregister(self) -> list[str]:
        lines: list[str] = []
        if self.path.exists() and self.user_manager_problem() is None:
            self.runner.run(self._systemctl("disable", "--now", SYSTEMD_UNIT))
            lines.append(f"stopped and disabled: {SYSTEMD_UNIT}")
        # What `enable` made, also when no manager runs now to undo it.
        link = self._wants_link()
        if link.is_symlink() or link.exists():
            link.unlink()
            lines.append(f"removed: {link}")
        remove_empty_dirs(link.parent, self.path.parent)
        return lines

    def _forget(self) -> None:
        if self.user_manager_problem() is None:
            self.runner.run(self._systemctl("daemon-reload"))
            self.runner.run(self._systemctl("reset-failed", SYSTEMD_UNIT))

    def start(self) -> list[str]:
        self._require_manager("start the service")
        self._check(self._systemctl("start", SYSTEMD_UNIT), "see `headroom service logs`")
        return [f"started: {SYSTEMD_UNIT}"]

    def stop(self) -> list[str]:
        self._require_manager("stop the service")
        self._check(self._systemctl("stop", SYSTEMD_UNIT), "see `headroom service logs`")
        return [f"stopped: {SYSTEMD_UNIT}"]

    def status(self) -> int:
        self._require_manager("ask for the service's status")
        return self.runner.attach(self._systemctl("status", "--no-pager", SYSTEMD_UNIT))

    def is_enabled(self) -> bool | None:
        """Whether the user manager starts the unit at login (``is-enabled``); None
        without a user manager to ask."""
        if self.user_manager_problem() is not None:
            return None
        return self.runner.run(self._systemctl("is-enabled", SYSTEMD_UNIT)).returncode == 0

    def active_state(self) -> str | None:
        """``active``, ``inactive``, ``failed``...; None without a user manager."""
        if self.user_manager_problem() is not None:
            return None
        return self.runner.run(self._systemctl("is-active", SYSTEMD_UNIT)).stdout.strip()

    def logs(self, lines: int, follow: bool) -> int:
        self._require_manager("show the service's log")
        argv = ["journalctl", "--user", "-u", SYSTEMD_UNIT, "-n", str(lines), "--no-pager"]
        if follow:
            argv.append("-f")
        return self.runner.attach(argv)


@dataclass
class LaunchdManager(Manager):
    """A LaunchAgent in ``~/Library/LaunchAgents``, loaded into the user's GUI domain."""

    name = "launchd LaunchAgent"

    @property
    def path(self) -> Path:
        return Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"

    def render(self) -> bytes:
        return render_launchd(self.spec).encode()

    @property
    def _target(self) -> str:
        return f"gui/{os.getuid()}/{LAUNCHD_LABEL}"

    def _register(self, changed: bool, start: bool) -> list[str]:
        if not start:
            return ["loads at the next login"]
        loaded = self.runner.run(["launchctl", "print", self._target]).returncode == 0
        if loaded and not changed:
            return [f"already loaded: {LAUNCHD_LABEL}"]
        if loaded:
            self.runner.run(["launchctl", "bootout", self._target])
        self._check(
            ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(self.path)],
            f"check {self.path} with `plutil -lint`",
        )
        return [f"loaded and started: {LAUNCHD_LABEL}"]

    def _unregister(self) -> list[str]:
        if self.runner.run(["launchctl", "bootout", self._target]).returncode == 0:
            return [f"stopped and unloaded: {LAUNCHD_LABEL}"]
        return []

    def start(self) -> list[str]:
        if self.runner.run(["launchctl", "print", self._target]).returncode != 0:
            if not self.path.exists():
                raise ServiceError("the service is not installed: run `headroom service install`")
            self._check(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(self.path)], "")
        else:
            self._check(["launchctl", "kickstart", self._target], "see `headroom service logs`")
        return [f"started: {LAUNCHD_LABEL}"]

    def stop(self) -> list[str]:
        # SIGTERM drains and exits 0, and KeepAlive restarts only after a failure.
        self._check(["launchctl", "kill", "SIGTERM", self._target], "is it running?")
        return [f"stopped: {LAUNCHD_LABEL}"]

    def status(self) -> int:
        return self.runner.attach(["launchctl", "print", self._target])


@dataclass
class TaskManager(Manager):
    """A Task Scheduler task that runs at the user's logon; its XML is kept in the user
    data folder (``%LOCALAPPDATA%\\headroom``) beside what ``schtasks`` registered."""

    name = "Task Scheduler logon task"

    @property
    def path(self) -> Path:
        return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "headroom-task.xml"

    def _user_id(self) -> str:
        domain = os.environ.get("USERDOMAIN")
        user = getpass.getuser()
        return f"{domain}\\{user}" if domain else user

    def render(self) -> bytes:
        return render_task(self.spec, self._user_id()).encode("utf-16")

    def _register(self, changed: bool, start: bool) -> list[str]:
        self._check(
            ["schtasks", "/Create", "/TN", TASK_NAME, "/XML", str(self.path), "/F"],
            "run it from your own (not an elevated) prompt",
        )
        lines = [f"registered to run at logon: task {TASK_NAME}"]
        if start:
            if changed:
                self.runner.run(["schtasks", "/End", "/TN", TASK_NAME])
            self._check(["schtasks", "/Run", "/TN", TASK_NAME], "see `headroom service logs`")
            lines.append(f"started: task {TASK_NAME}")
        return lines

    def _unregister(self) -> list[str]:
        self.runner.run(["schtasks", "/End", "/TN", TASK_NAME])
        result = self.runner.run(["schtasks", "/Delete", "/TN", TASK_NAME, "/F"])
        return [f"deleted: task {TASK_NAME}"] if result.returncode == 0 else []

    def start(self) -> list[str]:
        self._check(["schtasks", "/Run", "/TN", TASK_NAME], "is it installed?")
        return [f"started: task {TASK_NAME}"]

    def stop(self) -> list[str]:
        self._check(["schtasks", "/End", "/TN", TASK_NAME], "is it installed?")
        return [f"stopped: task {TASK_NAME}"]

    def status(self) -> int:
        return self.runner.attach(["schtasks", "/Query", "/TN", TASK_NAME, "/V", "/FO", "LIST"])


_MANAGERS: dict[str, type[Manager]] = {
    "linux": SystemdManager,
    "darwin": LaunchdManager,
    "win32": TaskManager,
}


def manager_for(platform: str | None = None, runner: Runner | None = None) -> Manager:
    """The manager of ``platform`` (default: this one) for this installation.

    Raises:
        ValueError: a platform without a service definition.
    """
    key = platform_key(platform)
    return _MANAGERS[key](spec=default_spec(key), runner=runner or Runner())
