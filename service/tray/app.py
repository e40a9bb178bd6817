"""``headroom tray``: the service in the desktop's tray (pystray; the ``tray`` extra).

The icon follows the service's events (:class:`~service.tray.link.EventFollower`) through
:class:`~service.tray.state.TrayModel`; its colour is the state (:mod:`.icons`), its
tooltip the headroom and the KV pool. The menu:

- the status line (the state and its reason);
- *Open dashboard*: the browser at ``/ui/#token=...``;
- *Pause* / *Resume* (``/api/control/pause``, ``/resume``), *Restart worker*
  (``/api/control/restart``);
- *Reserve*: auto, 1, 2 or 4 GiB (``/api/control/reserve``; held by the service until it
  restarts);
- *Start at login*: runs ``headroom service install`` or ``uninstall``; its check mark
  is what ``headroom service status`` last answered (exit 0: installed);
- *Quit* (the tray only; the service runs on).

What an action answered, or its error, shows in the tooltip (and as a notification where
the platform has them). Where the platform's tray has no menu (plain X11), a click opens
the dashboard.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import webbrowser
from collections.abc import Callable
from typing import Any

import pystray

from service.common.token import dashboard_url
from service.tray.icons import draw_icon
from service.tray.link import Answer, Control, EventFollower
from service.tray.state import TrayModel, TrayView

log = logging.getLogger("headroom.tray")

GiB = 1 << 30
# The reserve choices of the menu: (label, value sent to /api/control/reserve).
RESERVES: tuple[tuple[str, int | str], ...] = (
    ("Auto", "auto"),
    ("1 GiB", 1 * GiB),
    ("2 GiB", 2 * GiB),
    ("4 GiB", 4 * GiB),
)
LOGIN_TIMEOUT_S = 120.0


def headroom_command() -> list[str] | None:
    """How to run ``headroom`` (the console script next to this Python, else on PATH),
    or None when there is none."""
    from pathlib import Path

    beside = Path(sys.executable).with_name("headroom")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("headroom")
    return [found] if found else None


class TrayApp:
    """The tray icon and its menu for the service at ``base_url``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8427``.
        host, port: where the dashboard is (its link is built from them).
        token: the local token.
        open_url: opens the dashboard (default: the browser).
        run_command: runs ``headroom service ...`` (default: :func:`subprocess.run`);
            tests replace it.
    """

    def __init__(
        self,
        base_url: str,
        host: str,
        port: int,
        token: str,
        *,
        open_url: Callable[[str], Any] = webbrowser.open,
        run_command: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    ) -> None:
        self.model = TrayModel()
        self.view: TrayView = self.model.view
        self.control = Control(base_url, token)
        self.dashboard = dashboard_url(host, port, token)
        self.open_url = open_url
        self.run_command = run_command
        self.reserve: int | str = "auto"  # what this tray last set (the service keeps it)
        self.start_at_login = self._login_installed()
        self.changed = threading.Condition()  # notified on every new view (tests wait on it)
        self.icon = pystray.Icon("headroom", draw_icon(self.view.icon), "headroom", self._menu())
        self.icon.title = self._title(self.view.tooltip)
        self.follower = EventFollower(
            base_url,
            token,
            on_frame=lambda frame: self._show(self.model.apply(frame)),
            on_connection=lambda state: self._show(self.model.connection(state)),
        )

    # -- the icon -------------------------------------------------------------------------

    def _show(self, view: TrayView) -> None:
        with self.changed:
            old, self.view = self.view, view
            self.changed.notify_all()
        if view.icon is not old.icon:
            self.icon.icon = draw_icon(view.icon)
        if view.tooltip != old.tooltip:
            self.icon.title = self._title(view.tooltip)
        if view.status_line != old.status_line or view.paused != old.paused:
            self._refresh_menu()

    def _title(self, text: str) -> str:
        # X11's window name (pystray's xorg tooltip) is Latin-1; a reason or a process
        # name may hold any character.
        if type(self.icon).__module__.endswith("_xorg"):
            return text.encode("latin-1", "replace").decode("latin-1")
        return text

    def _refresh_menu(self) -> None:
        try:
            self.icon.update_menu()
        except NotImplementedError:  # a backend without menus (pystray's dummy)
            pass

    def wait_for(self, predicate: Callable[[TrayView], bool], timeout_s: float) -> TrayView:
        """Block until the view satisfies ``predicate`` (returned), or raise TimeoutError."""
        with self.changed:
            if not self.changed.wait_for(lambda: predicate(self.view), timeout_s):
                raise TimeoutError(f"the tray stayed at {self.view}")
            return self.view

    # -- the menu -------------------------------------------------------------------------

    def _menu(self) -> pystray.Menu:
        item = pystray.MenuItem
        return pystray.Menu(
            item(lambda _: self.view.status_line, None, enabled=False),
            item("Open dashboard", self.open_dashboard, default=True),
            item(lambda _: "Resume" if self.view.paused else "Pause", self.toggle_pause),
            item("Restart worker", self.restart),
            item(
                "Reserve for the desktop",
                pystray.Menu(
                    *(
                        item(
                            label,
                            self._reserve_action(value),
                            checked=self._reserve_checked(value),
                            radio=True,
                        )
                        for label, value in RESERVES
                    )
                ),
            ),
            item("Start at login", self.toggle_start_at_login, checked=lambda _: self.start_at_login),
            pystray.Menu.SEPARATOR,
            item("Quit", self.quit),
        )

    def _reserve_action(self, value: int | str) -> Callable[..., None]:
        return lambda *_: self.set_reserve(value)

    def _reserve_checked(self, value: int | str) -> Callable[[Any], bool]:
        return lambda _: self.reserve == value

    # -- actions (menu callbacks: pystray passes the icon and the item) ---------------------

    def open_dashboard(self, *_: Any) -> None:
        self.open_url(self.dashboard)

    def toggle_pause(self, *_: Any) -> Answer:
        answer = self.control.resume() if self.view.paused else self.control.pause()
        return self._say(answer)

    def restart(self, *_: Any) -> Answer:
        return self._say(self.control.restart())

    def set_reserve(self, value: int | str) -> Answer:
        answer = self.control.set_reserve(value)
        if answer.ok:
            self.reserve = value
        return self._say(answer)

    def toggle_start_at_login(self, *_: Any) -> Answer:
        verb = "uninstall" if self.start_at_login else "install"
        failure = self._service(verb)
        if failure is None:
            self.start_at_login = not self.start_at_login
            answer = Answer(True, f"start at login: {'off' if verb == 'uninstall' else 'on'}")
        else:
            answer = Answer(False, failure)
        self._refresh_menu()
        return self._say(answer)

    def quit(self, *_: Any) -> None:
        self.follower.stop()
        self.icon.stop()

    def _say(self, answer: Answer) -> Answer:
        (log.info if answer.ok else log.warning)("%s", answer.text)
        self._show(self.model.note(answer.text))
        if not answer.ok and getattr(self.icon, "HAS_NOTIFICATION", False):
            try:
                self.icon.notify(answer.text, "headroom")
            except Exception:  # a notification is a courtesy
                log.debug("notification failed", exc_info=True)
        return answer

    # -- start at login -------------------------------------------------------------------

    def _service(self, verb: str) -> str | None:
        """Run ``headroom service <verb>``: None when it succeeded, else what went wrong."""
        command = headroom_command()
        if command is None:
            return f"start at login failed: no `headroom` command found to run `service {verb}`"
        try:
            done = self.run_command(
                [*command, "service", verb],
                capture_output=True,
                text=True,
                timeout=LOGIN_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"start at login failed: headroom service {verb}: {exc}"
        if done.returncode != 0:
            out = (done.stderr or done.stdout or "").strip().splitlines()
            why = out[-1] if out else f"exit code {done.returncode}"
            return f"start at login failed: headroom service {verb}: {why}"
        return None

    def _login_installed(self) -> bool:
        command = headroom_command()
        if command is None:
            return False
        try:
            done = self.run_command(
                [*command, "service", "status"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    # -- running --------------------------------------------------------------------------

    def run(self) -> None:
        """Show the icon and follow the service until Quit (blocks; the main thread on
        macOS)."""

        def setup(icon: pystray.Icon) -> None:
            icon.visible = True
            self.follower.start()

        self.icon.run(setup)

    def run_detached(self) -> None:
        """Show the icon from another thread's loop (Linux, Windows; tests)."""
        self.icon.run_detached()
        self.icon.visible = True
        self.follower.start()
