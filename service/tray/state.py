"""What the tray shows, as a pure function of what the service sent.

:class:`TrayModel` folds the frames of ``/api/events`` (the snapshot, then each event, as
decoded JSON dicts) and the connection's ups and downs into a :class:`TrayView`: the
icon's state (:class:`IconState`, its colour), the tooltip, whether the menu offers
*Pause* or *Resume*, and the status line. No display, no network: tests feed it recorded
event sequences.

The supervisor's states map onto the icon: ``ready`` is *ready* (*busy* while requests
are in flight), ``starting``/``restarting`` *restarting*, ``waiting_for_memory`` and
``waiting_for_gpu`` *waiting*, ``paused`` and ``idle`` *paused*, ``failed`` and
``stopped`` *failed*; a state this version does not know is *unknown* (shown by name,
never taken for another), and no connection is *offline*.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from engine.common.units import fmt_bytes

# Windows cuts a tray tooltip at 127 characters (NOTIFYICONDATA.szTip holds 128 with
# the terminating NUL); the other platforms take at least that.
TOOLTIP_MAX = 127


class IconState(str, enum.Enum):
    """The icon's state; its value names the colour's meaning (see :mod:`.icons`)."""

    READY = "ready"
    BUSY = "busy"
    RESTARTING = "restarting"
    WAITING = "waiting"
    PAUSED = "paused"
    FAILED = "failed"
    UNKNOWN = "unknown"
    OFFLINE = "offline"


_ICON_OF_STATUS = {
    "ready": IconState.READY,
    "starting": IconState.RESTARTING,
    "restarting": IconState.RESTARTING,
    "waiting_for_memory": IconState.WAITING,
    "waiting_for_gpu": IconState.WAITING,
    "paused": IconState.PAUSED,
    "idle": IconState.PAUSED,
    "failed": IconState.FAILED,
    "stopped": IconState.FAILED,
}

# How a status reads in the tooltip and the menu.
_WORDS = {
    "waiting_for_memory": "waiting for memory",
    "waiting_for_gpu": "waiting for the GPU",
    "idle": "idle (model unloaded)",
}

# States from which the menu offers Resume instead of Pause.
PAUSED_STATUSES = frozenset({"paused", "idle"})


@dataclass(frozen=True)
class TrayView:
    """What the tray shows now.

    Attributes:
        icon: the icon's state (its colour).
        status: the service's state as it sent it (``"unknown"`` before the first
            ``health``, ``"offline"`` without a connection).
        tooltip: at most :data:`TOOLTIP_MAX` characters: the state, the headroom (or
            the host's available RAM in CPU mode) and the KV pool.
        status_line: the menu's first line, with the reason when there is one.
        paused: whether the menu offers Resume (else Pause).
    """

    icon: IconState
    status: str
    tooltip: str
    status_line: str
    paused: bool


@dataclass(frozen=True)
class _Facts:
    connection: str = "connecting"  # "connected", "connecting", "unauthorized", or why not
    status: str | None = None
    reason: str | None = None
    in_flight: int = 0
    headroom_bytes: int | None = None
    host_available_bytes: int | None = None
    kv_pool_bytes: int | None = None
    kv_free_pages: int | None = None
    kv_total_pages: int | None = None
    note: str | None = None  # the last control action's answer or error


class TrayModel:
    """Folds the event stream into a :class:`TrayView` (:attr:`view`).

    Feed it with :meth:`apply` (each decoded frame), :meth:`connection` (the socket's
    state) and :meth:`note` (what the last menu action answered). Unknown frame types
    and fields are ignored: a newer service may send more.
    """

    def __init__(self) -> None:
        self._facts = _Facts()

    # -- input ----------------------------------------------------------------------------

    def apply(self, frame: dict[str, Any]) -> TrayView:
        """One frame of ``/api/events`` (a snapshot or an event), as decoded JSON."""
        kind = frame.get("type")
        f = replace(self._facts, connection="connected")
        if kind == "snapshot":
            for key in ("health", "engine", "vram", "counters"):
                part = frame.get(key)
                if isinstance(part, dict):
                    f = _take(f, key, part)
        elif kind in ("health", "engine", "vram", "counters"):
            f = _take(f, kind, frame)
        self._facts = f
        return self.view

    def connection(self, state: str) -> TrayView:
        """The socket's state: ``"connected"``, ``"connecting"``, ``"unauthorized"`` (the
        token was refused), or a reason it is down."""
        self._facts = replace(self._facts, connection=state)
        return self.view

    def note(self, text: str | None) -> TrayView:
        """What the last menu action answered (or its error), shown in the tooltip."""
        self._facts = replace(self._facts, note=text)
        return self.view

    # -- output ---------------------------------------------------------------------------

    @property
    def view(self) -> TrayView:
        f = self._facts
        if f.connection != "connected":
            why = {
                "connecting": "connecting to the service...",
                "unauthorized": "the token was refused (headroom token shows the right one)",
            }.get(f.connection, f"service not reachable: {f.connection}")
            line = f"headroom: {why}"
            return TrayView(IconState.OFFLINE, "offline", _cut(line), line, paused=False)
        status = f.status or "unknown"
        icon = _ICON_OF_STATUS.get(status, IconState.UNKNOWN)
        if icon is IconState.READY and f.in_flight > 0:
            icon = IconState.BUSY
        words = _WORDS.get(status, status.replace("_", " "))
        if icon is IconState.BUSY:
            words = f"busy ({f.in_flight} in flight)"
        line = f"headroom: {words}" + (f": {f.reason}" if f.reason and status != "ready" else "")
        parts = [f"headroom: {words}"]
        if f.headroom_bytes is not None:
            parts.append(f"headroom {fmt_bytes(f.headroom_bytes)}")
        elif f.host_available_bytes is not None:
            parts.append(f"RAM free {fmt_bytes(f.host_available_bytes)}")
        if f.kv_pool_bytes is not None and status == "ready":
            pool = f"KV pool {fmt_bytes(f.kv_pool_bytes)}"
            if f.kv_free_pages is not None and f.kv_total_pages:
                pool += f" ({100 * f.kv_free_pages // f.kv_total_pages}% free)"
            parts.append(pool)
        if f.reason and status != "ready":
            parts.append(f.reason)
        if f.note:
            parts.append(f.note)
        return TrayView(icon, status, _cut("\n".join(parts)), line, status in PAUSED_STATUSES)


def _take(f: _Facts, kind: str, e: dict[str, Any]) -> _Facts:
    """The facts after one event of ``kind`` (its JSON fields in ``e``)."""
    if kind == "health":
        return replace(f, status=str(e.get("status") or "unknown"), reason=e.get("reason") or None)
    if kind == "engine":
        info = e.get("info") or {}
        return replace(f, kv_pool_bytes=info.get("kv_cache_bytes", f.kv_pool_bytes))
    if kind == "counters":
        engine = e.get("engine") or {}
        return replace(
            f,
            in_flight=int(e.get("in_flight") or 0),
            kv_free_pages=engine.get("free_pages"),
            kv_total_pages=engine.get("total_pages"),
        )
    if kind == "vram":
        if e.get("source") == "none":
            host = e.get("host") or {}
            return replace(f, headroom_bytes=None, host_available_bytes=host.get("available_bytes"))
        return replace(f, headroom_bytes=e.get("headroom_bytes"), host_available_bytes=None)
    return f


def _cut(text: str) -> str:
    return text if len(text) <= TOOLTIP_MAX else text[: TOOLTIP_MAX - 3] + "..."
