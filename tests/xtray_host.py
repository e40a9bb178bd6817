"""A minimal X11 system tray for tests: what a desktop panel does for tray icons, on a
bare Xvfb display.

It owns the ``_NET_SYSTEM_TRAY_S<screen>`` selection, announces itself with the
``MANAGER`` client message (freedesktop.org System Tray Protocol), and docks each icon
that asks (``SYSTEM_TRAY_REQUEST_DOCK``) by reparenting its window into a row of
``ICON_PX`` squares. :meth:`TrayHost.screenshot` grabs that row, so a test sees the
icon as a person would.
"""

from __future__ import annotations

import threading

from PIL import Image, ImageGrab
from Xlib import X, display
from Xlib.protocol import event

ICON_PX = 48
REQUEST_DOCK = 0


class TrayHost:
    """Runs on ``display_name`` (e.g. ``":5"``) in a thread until :meth:`close`."""

    def __init__(self, display_name: str) -> None:
        self.display_name = display_name
        self.d = display.Display(display_name)
        screen = self.d.screen()
        self.root = screen.root
        self.window = self.root.create_window(
            0, 0, ICON_PX * 4, ICON_PX, 0, screen.root_depth,
            background_pixel=screen.white_pixel,
            event_mask=X.StructureNotifyMask | X.SubstructureNotifyMask,
        )
        self.window.map()
        selection = self.d.intern_atom(f"_NET_SYSTEM_TRAY_S{self.d.get_default_screen()}")
        self.opcode = self.d.intern_atom("_NET_SYSTEM_TRAY_OPCODE")
        self.window.set_selection_owner(selection, X.CurrentTime)
        manager = event.ClientMessage(
            window=self.root,
            client_type=self.d.intern_atom("MANAGER"),
            data=(32, [X.CurrentTime, selection, self.window.id, 0, 0]),
        )
        self.root.send_event(manager, event_mask=X.StructureNotifyMask)
        self.d.flush()
        self.docked: list[int] = []
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="xtray-host", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closing:
            try:
                e = self.d.next_event()
            except Exception:
                return
            if e.type == X.ClientMessage and e.client_type == self.opcode:
                if e.data[1][1] == REQUEST_DOCK:
                    self._dock(e.data[1][2])

    def _dock(self, window_id: int) -> None:
        if window_id in self.docked:
            return  # pystray asks again with each new image
        icon = self.d.create_resource_object("window", window_id)
        x = ICON_PX * len(self.docked)
        icon.reparent(self.window, x, 0)
        icon.configure(x=x, y=0, width=ICON_PX, height=ICON_PX)
        icon.map()
        self.docked.append(window_id)
        self.d.flush()

    def screenshot(self) -> Image.Image:
        """The first docked icon's square, as on screen (RGB)."""
        return ImageGrab.grab(bbox=(0, 0, ICON_PX, ICON_PX), xdisplay=self.display_name)

    def close(self) -> None:
        self._closing = True
        try:
            self.window.destroy()
            self.d.flush()
            self.d.close()
        except Exception:
            pass
        self._thread.join(5)
