"""``headroom service install | uninstall | start | stop | status | logs``: headroom as
a login service of this OS (:mod:`service.autostart`), running this installation's
``headroom serve``.

Light at import (click only), like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

import click

from service.cli.exits import fail


def _manager():
    from service.autostart.manager import manager_for

    try:
        return manager_for()
    except ValueError as exc:
        fail(str(exc))


def _run(action) -> None:
    from service.autostart.manager import ServiceError

    try:
        for line in action():
            click.echo(line)
    except (ServiceError, OSError) as exc:
        fail(str(exc))


@click.group(
    epilog="Linux: a systemd user unit (~/.config/systemd/user/headroom.service), logs in "
    "the user journal. macOS: a LaunchAgent (~/Library/LaunchAgents/io.headroom.serve.plist). "
    "Windows: a Task Scheduler logon task named headroom. On macOS and Windows the log is "
    "headroom.log in the user log folder, rotated at 10 MiB (5 kept). Settings come from "
    "the config file (`headroom doctor` shows where it is)."
)
def service() -> None:
    """Run headroom at login as a service of this OS."""


@service.command()
@click.option(
    "--start/--no-start",
    default=True,
    show_default=True,
    help="Start it now as well as at every login.",
)
def install(start: bool) -> None:
    """Install (or update) the service, enable it at login and start it. Idempotent."""
    manager = _manager()
    _run(lambda: manager.install(start=start))


def _manager_command(name: str, help_text: str) -> None:
    """Add ``headroom service NAME``: the OS manager's method of that name, its lines
    printed."""

    @service.command(name, help=help_text)
    def command() -> None:
        _run(getattr(_manager(), name))


_manager_command("uninstall", "Stop the service and remove everything install made (logs are kept).")
_manager_command("start", "Start the installed service now.")
_manager_command("stop", "Stop the service (it starts again at the next login).")


@service.command()
def status() -> None:
    """The OS's view of the service (systemctl status, launchctl print, schtasks /Query)."""
    from service.autostart.manager import ServiceError

    manager = _manager()
    # Without a service manager to ask, "not installed" would send the user to an
    # install that cannot work either.
    problem = manager.user_manager_problem()
    if problem is not None:
        fail(f"cannot ask for the service's status: {problem}")
    if not manager.is_installed():
        fail("the service is not installed: `headroom service install` installs it")
    try:
        code = manager.status()
    except ServiceError as exc:
        fail(str(exc))
    raise SystemExit(code)


@service.command()
@click.option("-n", "--lines", default=50, show_default=True, help="Lines to show.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
def logs(lines: int, follow: bool) -> None:
    """The service's log: the user journal on Linux, the rotated file elsewhere."""
    from service.autostart.manager import ServiceError

    manager = _manager()
    try:
        code = manager.logs(lines, follow)
    except ServiceError as exc:
        fail(str(exc))
    raise SystemExit(code)
