"""Whether the desktop has a tray to show the icon in, asked before the icon is made.

pystray picks a backend at import (:data:`pystray.Icon`'s module) and, without a tray
host, logs a traceback for each icon update and shows nothing. The hosts each backend
needs:

- ``xorg`` and ``gtk``: an X11 system tray, the owner of the ``_NET_SYSTEM_TRAY_S<n>``
  selection of the display's screen (the XEmbed tray protocol);
- ``appindicator``: a StatusNotifierWatcher (``org.kde.StatusNotifierWatcher``) on the
  session bus, which KDE, most panels and GNOME's AppIndicator extension provide; the
  library falls back to the X11 tray without one.

Other backends (macOS, Windows, pystray's ``dummy``) always have one.
"""

from __future__ import annotations

import os

WATCHER = "org.kde.StatusNotifierWatcher"
_HOW = (
    "on GNOME install the AppIndicator and KStatusNotifierItem Support extension; on "
    "other desktops add a system tray (or status notifier) to the panel; the dashboard "
    "(`headroom serve` prints its address) shows the same"
)


def _x_tray_owned() -> bool:
    """Whether the X display of ``DISPLAY`` has a system tray (python-xlib, which
    pystray brings on Linux)."""
    if not os.environ.get("DISPLAY"):
        return False
    try:
        from Xlib import X, display

        d = display.Display()
    except Exception:  # no Xlib, no display: no X tray
        return False
    try:
        atom = d.intern_atom(f"_NET_SYSTEM_TRAY_S{d.get_default_screen()}")
        return d.get_selection_owner(atom) != X.NONE
    except Exception:
        return False
    finally:
        d.close()


def _watcher_on_bus() -> bool:
    """Whether a StatusNotifierWatcher owns its name on the session bus (through
    GLib's Gio, which the appindicator backend needs anyway)."""
    try:
        from gi.repository import Gio, GLib

        bus = Gio.bus_get_sync(Gio.BusType.SESSION, None)
        answer = bus.call_sync(
            "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "NameHasOwner",
            GLib.Variant("(s)", (WATCHER,)), GLib.VariantType("(b)"), Gio.DBusCallFlags.NONE, 2000, None,
        )
        return bool(answer.unpack()[0])
    except Exception:  # no gi, no session bus
        return False


def tray_host_problem(backend: str) -> str | None:
    """Why the icon of pystray's ``backend`` (its module, ``pystray._xorg``) would not
    show on this desktop, in one line naming the fix; None when a host is there."""
    name = backend.rpartition("._")[2]
    if name in ("xorg", "gtk"):
        if _x_tray_owned():
            return None
        where = os.environ.get("DISPLAY")
        what = f"the X display {where} has no system tray" if where else "no X display (DISPLAY is not set)"
        return f"no tray to show the icon in: {what}; {_HOW}"
    if name == "appindicator":
        if _watcher_on_bus() or _x_tray_owned():
            return None
        return f"no tray to show the icon in: no {WATCHER} on the session bus and no X system tray; {_HOW}"
    return None
