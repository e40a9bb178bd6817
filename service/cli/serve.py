"""``headroom serve``: bind the port, build the app and run it under uvicorn until a
signal drains it.

Light at import (click only): the worker is spawned and re-imports the parent's main
module, and must never import Litestar; uvicorn and the app are imported inside
:func:`serve`.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import click

from service.cli.exits import EXIT_FAILED, EXIT_USAGE, check_model_path, fail
from service.cli.logfile import setup_logging
from service.cli.options import config_option, resolve_or_fail, with_serve_options
from service.cli.precheck import (
    check_before_serving,
    check_model_before_loading,
    note_gpu_only_settings,
)
from service.common.settings import DEFAULT_PORT
from service.common.version import headroom_version

ADDRESSES = "give --host an address of this machine, such as 127.0.0.1 (the default), ::1 or 0.0.0.0"


class NotAnAddress(OSError):
    """``--host`` names no address of this machine: the user's setting (exit 2)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` before anything else starts, so a taken port
    fails the start at once (and no other process can take it in between).

    Raises:
        OSError: with the message ``"port N is in use"`` for EADDRINUSE.
        NotAnAddress: for a host that resolves to no address, or to none of this
            machine's, naming ``--host``.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:  # a name no resolver knows, an address of no family
        raise NotAnAddress(exc.errno, f"--host {host}: not an address of this machine ({exc.strerror}); {ADDRESSES}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    if sys.platform != "win32":
        # Reuse a port left in TIME_WAIT by our previous run; on POSIX this never
        # lets two live listeners share it (on Windows it would).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1)):
            raise OSError(exc.errno, f"port {port} is in use (on {host}): pass --port N (or set HEADROOM_PORT) "
                                     f"for another one, or stop the program that listens on it") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise NotAnAddress(exc.errno, f"--host {host}: not an address of this machine ({exc.strerror}); "
                                     f"{ADDRESSES}") from None
        raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _websocket_protocol() -> str:
    """uvicorn's sans-I/O websockets protocol where this uvicorn has it (0.35+: no
    deprecation warnings from the legacy websockets API), else its automatic choice."""
    try:
        from uvicorn.config import WS_PROTOCOLS
    except ImportError:  # pragma: no cover - a very old uvicorn
        return "auto"
    return "websockets-sansio" if "websockets-sansio" in WS_PROTOCOLS else "auto"


def _announce_dashboard_when_ready(supervisor: Any, host: str, port: int) -> None:
    """Once the first worker is ready, say where the dashboard is: a log line with its
    address, and on a terminal the link with the token as well (written to the terminal
    itself, never to the log, which a login service keeps in a file)."""
    from service.common.token import dashboard_url, read_token

    previous = supervisor.on_first_ready

    def announce() -> None:
        logging.getLogger("headroom.service").info(
            "headroom ready: dashboard at %s (`headroom token` prints the link with the token)",
            dashboard_url(host, port),
        )
        token = read_token()
        if token and sys.stderr.isatty():
            click.echo(f"open the dashboard: {dashboard_url(host, port, token)}", err=True)
        if previous is not None:
            previous()

    supervisor.on_first_ready = announce


@click.command(
    epilog=f"Settings come from, lowest first: defaults, the config file (TOML, keys as "
    f"the option names with underscores, e.g. port = {DEFAULT_PORT}), HEADROOM_* "
    f"environment variables, then these flags. The default port is {DEFAULT_PORT}."
)
@config_option
@with_serve_options
def serve(config_path: Path | None, **flags: Any) -> None:
    """Serve the OpenAI-compatible API on 127.0.0.1 with a supervised engine worker.

    With no arguments: the embedded default model on http://127.0.0.1:8427.
    """
    settings = resolve_or_fail(flags, config_path)
    try:
        log_path = setup_logging(settings.log_level, settings.log_file)
    except OSError as exc:
        fail(f"cannot open the log file for --log-file {settings.log_file}: {exc}")
    log = logging.getLogger("headroom.service")
    if log_path is not None:
        log.info("headroom %s logging to %s", headroom_version(), log_path)
    check_model_path(settings.model)
    check_before_serving(settings)  # what the settings ask of the model first, then its files
    note_gpu_only_settings(settings.device, settings.cpu_layers, settings.device_limit, settings.device_total)
    check_model_before_loading(settings.model, tokenizer=True)
    from service.cli.instance import AlreadyRunning, release_lock, remove_runtime, take_lock

    try:
        lock = take_lock()
    except AlreadyRunning as exc:
        fail(str(exc))
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        release_lock(lock)
        fail(exc.strerror or str(exc), EXIT_USAGE if isinstance(exc, NotAnAddress) else EXIT_FAILED)
    try:
        _serve_bound(settings, sock, log)
    finally:
        remove_runtime()
        release_lock(lock)


def _serve_bound(settings: Any, sock: socket.socket, log: logging.Logger) -> None:
    """Run the app on the bound ``sock`` until a signal drains it (``runtime.json``
    names it meanwhile)."""
    import uvicorn

    from service.cli.instance import write_runtime
    from service.common.token import token_path
    from service.http.app import StartupError, create_app
    from service.http.shutdown import WRITE_GRACE_S, GracefulServer

    failure: list[str] = []
    server: GracefulServer | None = None

    def on_start_failure(reason: str) -> None:
        failure.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        app, services = create_app(settings, on_start_failure=on_start_failure)
    except StartupError as exc:
        sock.close()
        fail(str(exc))
    host, port = sock.getsockname()[:2]
    write_runtime(host, port, token_path())
    _announce_dashboard_when_ready(services.supervisor, settings.host, port)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=WRITE_GRACE_S,
        ws=_websocket_protocol(),
        # h11 bounds the request line plus headers (--max-header-size); httptools would not.
        http="h11",
        h11_max_incomplete_event_size=settings.max_header_size,
    )
    # SIGTERM/SIGINT drain the requests in flight, then exit 0 (service.http.shutdown).
    server = GracefulServer(config, services.supervisor, settings.shutdown_timeout)
    log.info("headroom listening on http://%s:%d (engine starting)", host, port)
    server.run(sockets=[sock])
    if failure:
        fail(f"the engine could not start: {failure[0]}")
    if not server.started:
        fail("the server did not start")
