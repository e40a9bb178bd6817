"""Graceful shutdown of ``headroom serve`` on SIGTERM and SIGINT.

uvicorn's own handling does not fit a service whose requests run for seconds: on the
first signal it closes the listening socket at once (a new client sees a refused
connection, not a 503 saying why), gives requests a fixed grace, then cancels them
mid-answer (a stream simply stops; a non-streaming request gets a text/plain 500), and
afterwards raises the signal again, so the process ends by the signal instead of
exiting 0. :class:`GracefulServer` replaces that handler:

1. first signal: the supervisor refuses new work (503 + Retry-After, OpenAI's error
   shape; :meth:`service.supervision.supervisor.Supervisor.begin_shutdown`) while the server keeps
   listening, and what is in flight runs on;
2. when nothing is left in flight, or after ``shutdown_timeout_s`` seconds, each
   remaining sequence ends with ``server_shutting_down`` (a final error event and
   ``data: [DONE]`` in a stream, a 503 JSON error otherwise);
3. the event hub closes: each ``/api/events`` socket gets close code 1001 and "the
   service is stopping" (:mod:`service.control.socket`), given
   :data:`EVENTS_CLOSE_S` to leave before uvicorn's shutdown would close the socket
   with its own 1012 (Service Restart, no reason);
4. then uvicorn's shutdown runs: it waits for those answers to be written, and the
   app's lifespan stops the worker (no restart) and removes its pid-file entry;
   ``headroom serve`` exits 0.

A second signal skips the rest of the wait (step 2 at once); a third exits without
waiting for connections. The worker ignores SIGINT (a Ctrl-C in a terminal reaches the
whole process group): the supervisor stops it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from service.supervision.supervisor import Supervisor

log = logging.getLogger("headroom.service")

# Seconds uvicorn waits, after the drain, for the last answers to be written and for
# connections (the event socket, idle keep-alives) to close.
WRITE_GRACE_S = 5.0

# Seconds the event sockets get, once the hub has closed them, to send their close
# frames (1001) before uvicorn's shutdown closes what is left with 1012.
EVENTS_CLOSE_S = 0.25


class GracefulServer(uvicorn.Server):
    """A ``uvicorn.Server`` that drains the supervisor's requests on SIGTERM/SIGINT (see
    the module docstring) and exits normally afterwards.

    Args:
        config: uvicorn's config; its ``timeout_graceful_shutdown`` should be
            :data:`WRITE_GRACE_S` (the drain itself is ``shutdown_timeout_s``).
        supervisor: the app's supervisor.
        shutdown_timeout_s: seconds requests in flight may run on after the first signal.
    """

    def __init__(
        self, config: uvicorn.Config, supervisor: Supervisor, shutdown_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.supervisor = supervisor
        self.shutdown_timeout_s = shutdown_timeout_s
        self.signals_seen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (main thread, between two bytecodes of whatever runs):
        hand the work to the event loop; never record the signal for re-raising."""
        self.signals_seen += 1
        name = signal.Signals(sig).name
        loop = self._loop
        if self.signals_seen >= 3 or loop is None or loop.is_closed():
            self.should_exit = True
            self.force_exit = self.signals_seen >= 3
            return
        loop.call_soon_threadsafe(self._on_signal, name, self.signals_seen)

    def _on_signal(self, name: str, count: int) -> None:
        if count == 1:
            in_flight = self.supervisor.link.in_flight
            log.info(
                "%s: shutting down; new requests get 503, %d sequence(s) in flight may "
                "finish within %.0f s",
                name,
                in_flight,
                self.shutdown_timeout_s,
            )
            self.supervisor.begin_shutdown(self.shutdown_timeout_s)
            self._drain = asyncio.ensure_future(self._run_drain())
        else:
            log.info("%s again: ending the requests in flight now", name)
            self.supervisor.end_drain_now()

    async def _run_drain(self) -> None:
        try:
            ended = await self.supervisor.drain(self.shutdown_timeout_s)
            if ended:
                log.warning(
                    "ended %d sequence(s) still running at the shutdown deadline "
                    "(--shutdown-timeout %.0f s) with server_shutting_down",
                    ended,
                    self.shutdown_timeout_s,
                )
        except Exception:
            log.exception("the shutdown drain failed; stopping anyway")
        finally:
            await self._close_event_sockets()
            self.should_exit = True

    async def _close_event_sockets(self) -> None:
        """Close the event hub (1001 to every subscriber) and give the sockets
        :data:`EVENTS_CLOSE_S` to say so; never raises."""
        hub = self.supervisor.events
        if hub is None:
            return
        try:
            hub.close()
            await asyncio.sleep(EVENTS_CLOSE_S)
        except Exception:
            log.exception("closing the event sockets failed; stopping anyway")
