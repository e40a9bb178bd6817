"""The ``headroom`` command: ``serve``, ``bench serve`` (and the engine's commands).

This module stays light at import (click only): the worker is started with the
*spawn* method, which re-imports the parent's main script (this console script) in
the child, and the worker must never import Litestar. Commands import what they need
inside their function; commands that run the engine in-process (``generate``,
``bench engine``) import engine modules there, never here.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import click

from service.settings import DEFAULT_PORT, OPTIONS, SettingsError, resolve

EXIT_USAGE = 2


@click.group()
def main() -> None:
    """headroom: a local LLM service that plans every byte of GPU memory."""


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"headroom: error: {message}", err=True)
    sys.exit(code)


def _option_decorators() -> list[Any]:
    """Click options built from service.settings.OPTIONS, so --help lists each one
    with its environment variable and default."""
    decorators = []
    for opt in OPTIONS:
        default = ", ".join(opt.default) if opt.multiple else opt.default
        shown = "unset" if default in (None, "") else default
        help_text = f"{opt.help} [env: {opt.env}; default: {shown}]"
        if opt.type is bool:
            name = opt.flag[2:]
            decorators.append(
                click.option(f"--{name}/--no-{name}", opt.name, default=None, help=help_text)
            )
        else:
            decorators.append(
                click.option(
                    opt.flag,
                    opt.name,
                    type=opt.type,
                    default=None,
                    multiple=opt.multiple,
                    help=help_text,
                )
            )
    return decorators


def _with_serve_options(func: Any) -> Any:
    for decorator in reversed(_option_decorators()):
        func = decorator(func)
    return func


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` before anything else starts, so a taken port
    fails the start at once (and no other process can take it in between).

    Raises:
        OSError: with the message ``"port N is in use"`` for EADDRINUSE.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
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
            raise OSError(exc.errno, f"port {port} is in use (on {host})") from None
        raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@main.command(
    epilog=f"Settings come from, lowest first: defaults, the config file (TOML, keys as "
    f"the option names with underscores, e.g. port = {DEFAULT_PORT}), HEADROOM_* "
    f"environment variables, then these flags. The default port is {DEFAULT_PORT}."
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML config file [env: HEADROOM_CONFIG; default: "
    "<user config dir>/headroom/config.toml].",
)
@_with_serve_options
def serve(config_path: Path | None, **flags: Any) -> None:
    """Serve the OpenAI-compatible API on 127.0.0.1 with a supervised engine worker.

    With no arguments: the embedded default model on http://127.0.0.1:8427.
    """
    try:
        settings = resolve(flags, config_path=config_path)
    except SettingsError as exc:
        _fail(str(exc), EXIT_USAGE)
    _setup_logging(settings.log_level)
    log = logging.getLogger("headroom.service")
    if settings.model is not None and not Path(settings.model).expanduser().exists():
        _fail(f"model not found: {settings.model} (no such file or folder)", EXIT_USAGE)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        _fail(exc.strerror or str(exc))

    import uvicorn

    from service.app import create_app

    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_start_failure(reason: str) -> None:
        failure.append(reason)
        if server is not None:
            server.should_exit = True

    app, _ = create_app(settings, on_start_failure=on_start_failure)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    log.info("headroom listening on http://%s:%d (engine starting)", host, port)
    server.run(sockets=[sock])
    if failure:
        _fail(f"the engine could not start: {failure[0]}")
    if not server.started:
        _fail("the server did not start")


@main.group()
def bench() -> None:
    """Benchmarks (not tests): print figures for the README."""


@bench.command("serve")
@click.option(
    "--url",
    default=f"http://127.0.0.1:{DEFAULT_PORT}",
    show_default=True,
    help="Base URL of a running headroom serve.",
)
@click.option(
    "-n",
    "--requests",
    "num_requests",
    type=int,
    default=32,
    show_default=True,
    help="Requests to send.",
)
@click.option(
    "-c",
    "--concurrency",
    type=int,
    default=None,
    help="Requests in flight at once [default: all of them].",
)
@click.option(
    "--max-tokens",
    type=int,
    default=64,
    show_default=True,
    help="Completion tokens per request (EOS ignored, so every request runs this long).",
)
@click.option(
    "--prompt-words",
    type=int,
    default=64,
    show_default=True,
    help="Approximate prompt length, in words.",
)
@click.option("--api-key", envvar="HEADROOM_API_KEY", default=None, help="Key for /v1, if set.")
@click.option(
    "--engine/--no-engine",
    "engine_baseline",
    default=True,
    show_default=True,
    help="Also run the engine in-process on the same prompts, for the service's overhead.",
)
@click.option(
    "--device", default="auto", show_default=True, help="Device of the in-process engine run."
)
def bench_serve(
    url: str,
    num_requests: int,
    concurrency: int | None,
    max_tokens: int,
    prompt_words: int,
    api_key: str | None,
    engine_baseline: bool,
    device: str,
) -> None:
    """Send N concurrent streaming requests to a running server; print TTFT and ITL
    percentiles, throughput, and the overhead against the engine alone."""
    from service.bench_serve import BenchOptions, run_bench

    run_bench(
        BenchOptions(
            url=url.rstrip("/"),
            num_requests=num_requests,
            concurrency=concurrency or num_requests,
            max_tokens=max_tokens,
            prompt_words=prompt_words,
            api_key=api_key,
            engine_baseline=engine_baseline,
            device=device,
        )
    )


if __name__ == "__main__":
    main()
