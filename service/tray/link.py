"""The tray's line to a running service, through its public API only.

:class:`EventFollower` follows ``/api/events`` in a thread (the token as the
``headroom.token.<token>`` subprotocol, as the dashboard sends it): each frame goes to
``on_frame`` as decoded JSON, each change of the connection to ``on_connection``; it
reconnects with exponential backoff (0.5 s up to 10 s) and stops retrying when the
token is refused (close code 4001). :class:`Control` posts the control actions with
``Authorization: Bearer <token>`` and turns any answer into one line for people.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from service.events.control_schemas import SUBPROTOCOL_PREFIX
from service.events.schemas import CLOSE_UNAUTHORIZED

log = logging.getLogger("headroom.tray")

BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 10.0


class EventFollower:
    """Follows the event socket of ``base_url`` until :meth:`stop`.

    Args:
        base_url: the service, e.g. ``http://127.0.0.1:8427``.
        token: the local token.
        on_frame: called (in the follower's thread) with each decoded frame.
        on_connection: called with ``"connected"``, ``"connecting"``,
            ``"unauthorized"`` or a short reason the service is not reachable.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        on_frame: Callable[[dict[str, Any]], None],
        on_connection: Callable[[str], None],
    ) -> None:
        self.url = base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        self.url = self.url.rstrip("/") + "/api/events"
        self.token = token
        self.on_frame = on_frame
        self.on_connection = on_connection
        self._stop = threading.Event()
        self._socket: Any = None
        self._thread = threading.Thread(target=self._run, name="tray-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the socket and end the thread (waits up to ``timeout_s``)."""
        self._stop.set()
        socket = self._socket
        if socket is not None:
            socket.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self._stop.is_set():
            self.on_connection("connecting")
            try:
                with connect(
                    self.url,
                    subprotocols=[SUBPROTOCOL_PREFIX + self.token],  # type: ignore[list-item]
                    open_timeout=10,
                    max_size=None,
                ) as socket:
                    self._socket = socket
                    for text in socket:
                        delay = BACKOFF_INITIAL_S
                        self._deliver(text)
            except ConnectionClosed as exc:
                if exc.rcvd is not None and exc.rcvd.code == CLOSE_UNAUTHORIZED:
                    self.on_connection("unauthorized")
                    return  # retrying with the same token cannot help
                why = "the service closed the connection"
            except (OSError, InvalidStatus, TimeoutError) as exc:
                why = _short(exc)
            else:
                why = "the service closed the connection"
            finally:
                self._socket = None
            if self._stop.is_set():
                return
            self.on_connection(why)
            self._stop.wait(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)


    def _deliver(self, text: str | bytes) -> None:
        # A frame the tray cannot show must not end the following: log it and go on.
        try:
            self.on_frame(json.loads(text))
            self.on_connection("connected")
        except Exception:
            log.exception("could not show an event of the service")


def _short(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is `headroom serve` running?)"
    return str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__


@dataclass(frozen=True)
class Answer:
    """What a control action came to: ``ok`` and one line for people (the service's
    message, or its error with the status)."""

    ok: bool
    text: str


class Control:
    """The control routes of ``base_url`` with ``token``; each call returns an
    :class:`Answer` and never raises (a service that is down is an answer too)."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def restart(self) -> Answer:
        return self._post("restart")

    def pause(self) -> Answer:
        return self._post("pause")

    def resume(self) -> Answer:
        return self._post("resume")

    def set_reserve(self, reserve: int | str) -> str:
        """``reserve``: bytes, a size such as ``"2GiB"``, or ``"auto"``."""
        return self._post("reserve", {"reserve": reserve})

    def _post(self, action: str, body: dict[str, Any] | None = None) -> Answer:
        try:
            r = httpx.post(
                f"{self.base_url}/api/control/{action}",
                headers={"Authorization": f"Bearer {self.token}"},
                json=body,
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            return Answer(False, f"{action} failed: {_short(exc)}")
        try:
            answer = r.json()
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        if r.is_success:
            return Answer(True, f"{action}: {answer.get('message') or 'done'}")
        error = answer.get("error")
        message = error.get("message") if isinstance(error, dict) else r.text[:120]
        return Answer(False, f"{action} failed ({r.status_code}): {message}")
