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

from service.cli.models import models, pull
from service.cli.settings import (
    DEFAULT_PORT,
    OPTIONS,
    OPTIONS_BY_NAME,
    Option,
    SettingsError,
    parse_size,
    resolve,
)

EXIT_USAGE = 2
EXIT_FAILED = 1


@click.group()
def main() -> None:
    """headroom: a local LLM service that plans every byte of GPU memory."""


main.add_command(models)
main.add_command(pull)


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"headroom: error: {message}", err=True)
    sys.exit(code)


def _settings_option(opt: Option, flag: str | None = None, *, show_env: bool = True) -> Any:
    """A click option for one setting of service.cli.settings.OPTIONS (``flag`` renames it
    on the command line; the value still lands under the setting's name), with its
    environment variable and default in the help."""
    default = ", ".join(opt.default) if opt.multiple else opt.default
    shown = "unset" if default in (None, "") else default
    if opt.type is bool:
        shown = "on" if default else "off"
    env = f"env: {opt.env}; " if show_env else ""
    help_text = f"{opt.help} [{env}default: {shown}]"
    name = (flag or opt.flag)[2:]
    if opt.type is bool:
        return click.option(f"--{name}/--no-{name}", opt.name, default=None, help=help_text)
    return click.option(
        f"--{name}",
        opt.name,
        type=opt.type,
        default=None,
        multiple=opt.multiple,
        metavar=opt.metavar,
        help=help_text,
    )


def _option_decorators() -> list[Any]:
    """Click options built from service.cli.settings.OPTIONS, so --help lists each one
    with its environment variable and default."""
    return [_settings_option(opt) for opt in OPTIONS]


def _with_serve_options(func: Any) -> Any:
    for decorator in reversed(_option_decorators()):
        func = decorator(func)
    return func


def _with_settings(*names: str, renamed: dict[str, str] | None = None) -> Any:
    """Decorate a command with the settings ``names`` (serve's options, same help,
    environment variables and config keys)."""
    renamed = renamed or {}

    def wrap(func: Any) -> Any:
        for name in reversed(names):
            func = _settings_option(OPTIONS_BY_NAME[name], renamed.get(name))(func)
        return func

    return wrap


_config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML config file [env: HEADROOM_CONFIG; default: "
    "<user config dir>/headroom/config.toml].",
)


def _check_model_path(model: str | None) -> None:
    """Fail fast, before torch is imported, for a model that is neither a path nor a
    name in the store."""
    if model is None or Path(model).expanduser().exists():
        return
    from engine.loader.errors import ModelNotFound
    from engine.loader.store import find_model

    try:
        found = find_model(model)
    except ModelNotFound as exc:
        _fail(str(exc), EXIT_USAGE)
    if found is None:
        _fail(
            f"model not found: {model} (no such file or folder, and no such name in the "
            "store: `headroom models` lists it); pass a Hugging Face model folder, a "
            ".gguf file or a store name with --model (`headroom pull REPO[:FILE]` "
            "fetches one), or leave --model out for the default model",
            EXIT_USAGE,
        )


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
@_config_option
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
    _check_model_path(settings.model)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        _fail(exc.strerror or str(exc))

    import uvicorn

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
        _fail(str(exc))
    host, port = sock.getsockname()[:2]
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
        _fail(f"the engine could not start: {failure[0]}")
    if not server.started:
        _fail("the server did not start")


def _websocket_protocol() -> str:
    """uvicorn's sans-I/O websockets protocol where this uvicorn has it (0.35+: no
    deprecation warnings from the legacy websockets API), else its automatic choice."""
    try:
        from uvicorn.config import WS_PROTOCOLS
    except ImportError:  # pragma: no cover - a very old uvicorn
        return "auto"
    return "websockets-sansio" if "websockets-sansio" in WS_PROTOCOLS else "auto"


@main.command(
    epilog="The token guards the control routes (/api/control/*) and the event socket "
    "(/api/events); send it as 'Authorization: Bearer <token>'. It is created (owner-only) "
    "on first use; HEADROOM_CONFIG_DIR moves its folder."
)
@_config_option
@_with_settings("host", "port")
def token(config_path: Path | None, **flags: Any) -> None:
    """Print the local token's file and the dashboard's address with the token."""
    settings = _resolve_or_fail(flags, config_path)
    from service.events.token import load_or_create_token, token_path

    try:
        value = load_or_create_token()
    except OSError as exc:
        _fail(f"cannot read or create the local token {token_path()}: {exc}")
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    click.echo(f"token file: {token_path()}")
    # A fragment never leaves the browser (not sent, not logged); the page reads it and
    # takes it out of the address bar and the history entry.
    click.echo(f"dashboard:  http://{host}:{settings.port}/ui/#token={value}")


# Engine options (declared on engine.config.EngineConfig) that generate and plan share
# with serve: same flags, variables and config keys.
_MODEL_OPTIONS = ("model", "device", "dtype")
_PLAN_KNOBS = (
    "reserve",
    "device_limit",
    "max_prefill_tokens",
    "max_running_requests",
    "max_model_len",
    "min_context",
)


def _resolve_or_fail(flags: dict[str, Any], config_path: Path | None) -> Any:
    try:
        return resolve(flags, config_path=config_path)
    except SettingsError as exc:
        _fail(str(exc), EXIT_USAGE)


@main.command(
    epilog="Engine settings (--model, --reserve, --max-model-len...) are serve's: they "
    "are also read from HEADROOM_* variables and the config file. One prompt runs, so "
    "the plan holds one request (--max-running-requests 1)."
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Most tokens to generate.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0.0, 2.0),
    default=0.7,
    show_default=True,
    help="Sampling temperature; 0 is greedy.",
)
@click.option("--seed", type=int, default=None, help="Seed of the sampler (same seed, same reply).")
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap the prompt in the model's chat template as a user message, or send it as is.",
)
@_config_option
@_with_settings(
    *_MODEL_OPTIONS,
    "max_model_len",
    "max_prefill_tokens",
    "reserve",
    "device_limit",
    "min_context",
)
@click.argument("prompt")
def generate(
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    chat: bool,
    config_path: Path | None,
    **flags: Any,
) -> None:
    """Stream one reply to PROMPT to stdout, with the engine in this process."""
    settings = _resolve_or_fail(flags, config_path)
    _check_model_path(settings.model)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from dataclasses import replace

    from engine.commands.generate import GenerationFailed, run_generate
    from engine.errors import PlanDoesNotFit, RequestRejected
    from engine.loader.errors import ModelLoadError
    from engine.text.chat import ChatTemplateError

    config = replace(settings.engine_config(), max_running_requests=1)
    try:
        run_generate(
            model=settings.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            chat=chat,
            config=config,
        )
    except ModelLoadError as exc:
        _fail(f"cannot load the model: {exc}", EXIT_USAGE)
    except PlanDoesNotFit as exc:
        _fail(str(exc))
    except ChatTemplateError as exc:
        _fail(f"{exc.message}; pass --raw to send the prompt without the chat template")
    except RequestRejected as exc:
        fix = "shorten the prompt"
        if settings.max_model_len is not None:
            fix += f" or raise --max-model-len (now {settings.max_model_len})"
        _fail(f"the prompt cannot run: {exc.message}; {fix}")
    except GenerationFailed as exc:
        hint = (
            "; free device memory (close other GPU applications) or lower "
            "--max-prefill-tokens, then try again"
            if exc.code == "out_of_memory"
            else ""
        )
        click.echo()
        _fail(f"{exc.message}{hint}")
    except ValueError as exc:  # a bad config value the engine refused (dtype, device)
        _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        click.echo()
        sys.exit(130)


@main.command(
    epilog="Without a GPU, plan for a simulated one: --device-total 6GiB --device-free "
    "5.5GiB. Sizes: 6GiB, 5.5GiB, 512MiB, 6GB (decimal) or bytes. Settings are serve's: "
    "also read from HEADROOM_* variables and the config file. Exits 0 when the plan "
    "fits, 1 when it does not (with what would fix it), 2 for a usage error."
)
@_config_option
@_with_settings(
    *_MODEL_OPTIONS,
    "device_total",
    "device_free",
    "device_display",
    *_PLAN_KNOBS,
    "page_size",
    renamed={"device_display": "--display"},
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(config_path: Path | None, as_json: bool, **flags: Any) -> None:
    """Print the memory plan (the ledger from device total to KV pages) for a model and a
    device, without loading the weights or serving."""
    settings = _resolve_or_fail(flags, config_path)
    _check_model_path(settings.model)

    from engine.commands.plan import NoDevice, build_plan, planned_setup, render
    from engine.loader.errors import ModelLoadError

    try:
        config = settings.engine_config()
        device, dtype = planned_setup(config)
        memory_plan = build_plan(config)
    except NoDevice as exc:
        _fail(str(exc), EXIT_USAGE)
    except ModelLoadError as exc:
        _fail(f"cannot read the model: {exc}", EXIT_USAGE)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    click.echo(render(memory_plan, as_json, f"{str(dtype).removeprefix('torch.')} on {device}"))
    if not memory_plan.fits:
        sys.exit(EXIT_FAILED)


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
    from service.bench.serve import BenchOptions, run_bench

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


@bench.command(
    "chaos",
    epilog="Without --url it starts `headroom serve` itself (logs, token and fault folder "
    "in --workdir) on a simulated 4 GiB card playing a desktop loop (--vram-timeline to "
    "play yours), or on the real card with --hog. Exits 1 when a figure that must be 0 "
    "is not (hung, undocumented failures, wrong outputs, orphans, leaked pages).",
)
@click.option(
    "-n",
    "--requests",
    "num_requests",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Requests to send.",
)
@click.option(
    "-c",
    "--clients",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Concurrent clients.",
)
@click.option(
    "--kills",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Times the worker is SIGKILLed, at random points.",
)
@click.option(
    "--ooms",
    type=click.IntRange(min=0),
    default=50,
    show_default=True,
    help="Out-of-memory errors injected at random sites and points.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=24,
    show_default=True,
    help="Completion tokens of a greedy request.",
)
@click.option(
    "--url",
    default=None,
    help="A running headroom serve (started with "
    "HEADROOM_FAULTS_DIR=--faults-dir for OOMs) [default: start one].",
)
@click.option(
    "--faults-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="With --url: the service's HEADROOM_FAULTS_DIR.",
)
@click.option(
    "--token",
    default=None,
    help="With --url: the local token, to clear the "
    "prefix cache for the leak check [default: this user's].",
)
@click.option("--model", default=None, help="Model of the started service [default: embedded].")
@click.option("--device", default="auto", show_default=True, help="Device of the started service.")
@click.option(
    "--vram-timeline",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Timeline file of the simulated card [default: a desktop loop].",
)
@click.option(
    "--hog",
    "hog_gib",
    type=click.FloatRange(min=0.05),
    default=None,
    metavar="GiB",
    help="Run a second process taking and freeing up to GiB of GPU memory with "
    "torch, and serve against the real card (NVML) instead of a simulated one.",
)
@click.option(
    "--hang-timeout",
    "hang_s",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    help="Seconds after which a request with no ending is hung.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the mix and timing.")
@click.option(
    "--serve-arg",
    "serve_args",
    multiple=True,
    metavar="ARG",
    help="An argument for the started `headroom serve`, e.g. --serve-arg=--max-prefill-tokens "
    "--serve-arg=512 (repeatable).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the started service's log, token and faults [default: a new temporary one].",
)
def bench_chaos(**kwargs: Any) -> None:
    """Send many requests while killing the worker, injecting OOMs and moving the
    desktop's memory; print what succeeded, failed (by code), hung or came out wrong,
    restarts, time back to ready, orphans, leaked pages and TTFT."""
    from service.bench.chaos import ChaosOptions, run_chaos

    if kwargs["url"] is None and kwargs["token"] is not None:
        _fail(
            "--token goes with --url (a started service's token is read from --workdir)", EXIT_USAGE
        )
    opts = ChaosOptions(requests=kwargs.pop("num_requests"), **kwargs)
    try:
        report = run_chaos(opts, out=click.echo)
    except RuntimeError as exc:
        _fail(f"chaos run: {exc}")
    problems = report.problems()
    for problem in problems:
        click.echo(f"PROBLEM: {problem}", err=True)
    if problems:
        sys.exit(EXIT_FAILED)


def _int_list(ctx: Any, param: Any, value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        items = ()
    if not items or min(items) < 1:
        raise click.BadParameter(
            f"{value!r}: give positive integers separated by commas, e.g. 1,16"
        )
    return items


@bench.command("engine")
@click.option(
    "--model", default=None, help="Hugging Face folder or .gguf file [default: the embedded model]."
)
@click.option(
    "--shape",
    default=None,
    help="Bench a known model shape with random weights instead of --model "
    "(smollm2-135m, qwen3-0.6b, llama-3.1-8b).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option(
    "--attention-backend",
    type=click.Choice(["auto", "triton", "flashinfer", "torch"]),
    default="auto",
    show_default=True,
    help="Attention kernels of the engine side.",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=True,
    show_default=True,
    help="Replay decode steps as CUDA graphs.",
)
@click.option(
    "--long-prefill-tokens",
    type=click.IntRange(min=0),
    default=8192,
    show_default=True,
    help="Length of the one long prompt measured besides the batches (capped by the "
    "model's context; 0 skips it).",
)
@click.option(
    "--transformers/--no-transformers",
    "transformers_side",
    default=True,
    show_default=True,
    help="Also run transformers' generate, the comparison.",
)
@click.option(
    "--profile",
    is_flag=True,
    default=False,
    help="Afterwards, print where a decode step's time goes at each --profile-batches "
    "size (host, graph replay, the kernels inside it; CUDA).",
)
@click.option(
    "--profile-batches",
    default="1",
    show_default=True,
    callback=_int_list,
    help="Batch sizes --profile looks at, comma-separated.",
)
@click.option(
    "--batches",
    default="1,16,64",
    show_default=True,
    callback=_int_list,
    help="Batch sizes, comma-separated.",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Prompt length, in tokens (random ids).",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=2),
    default=32,
    show_default=True,
    help="Tokens generated per request (greedy, EOS ignored).",
)
def bench_engine(
    model: str | None,
    shape: str | None,
    device: str,
    attention_backend: str,
    cuda_graphs: bool,
    long_prefill_tokens: int,
    transformers_side: bool,
    profile: bool,
    profile_batches: tuple[int, ...],
    batches: tuple[int, ...],
    prompt_tokens: int,
    new_tokens: int,
) -> None:
    """Prefill and decode tokens/s of the engine against transformers' generate on the
    same model, device and dtype, at each batch size and on one long prompt; on CUDA
    each figure also as a share of the HBM roofline."""
    _check_model_path(model)
    from engine.commands.bench import run_bench_engine
    from engine.commands.model_shapes import SHAPES
    from engine.loader.errors import ModelLoadError

    if shape is not None and shape not in SHAPES:
        _fail(f"unknown --shape {shape!r}; known: {', '.join(SHAPES)}", EXIT_USAGE)
    try:
        run_bench_engine(
            model=model,
            shape=shape,
            device=device,
            batches=batches,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            long_prefill_tokens=long_prefill_tokens,
            transformers_side=transformers_side,
            profile=profile,
            profile_batches=profile_batches,
        )
    except ModelLoadError as exc:
        _fail(f"cannot load the model: {exc}", EXIT_USAGE)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)


# (shape, device limit): random-weight shapes of engine.commands.model_shapes on a capped card.
DEFAULT_MEMORY_CASES = ("qwen3-0.6b:6GiB", "qwen3-0.6b:16GiB", "llama-3.1-8b:24GiB")


@bench.command("memory")
@click.option(
    "--case",
    "cases",
    multiple=True,
    metavar="SHAPE:SIZE",
    help="A model shape (qwen3-0.6b, llama-3.1-8b, or default for the embedded "
    "model) and the device limit to cap it at; repeatable "
    f"[default: {', '.join(DEFAULT_MEMORY_CASES)}].",
)
@click.option("--max-model-len", type=click.IntRange(min=16), default=8192, show_default=True)
@click.option("--max-running-requests", type=click.IntRange(min=2), default=16, show_default=True)
@click.option("--max-prefill-tokens", type=click.IntRange(min=16), default=2048, show_default=True)
def bench_memory(
    cases: tuple[str, ...], max_model_len: int, max_running_requests: int, max_prefill_tokens: int
) -> None:
    """Predicted vs measured memory peak at the plan's worst step, and the KV pool's share
    of the budget, per case (needs a CUDA device)."""
    from engine.commands.model_shapes import SHAPES

    parsed = []
    for case in cases or DEFAULT_MEMORY_CASES:
        shape, sep, size = case.rpartition(":")
        if not sep or (shape != "default" and shape not in SHAPES):
            _fail(
                f"--case {case!r}: expected SHAPE:SIZE with SHAPE one of default, "
                f"{', '.join(SHAPES)}, e.g. qwen3-0.6b:6GiB",
                EXIT_USAGE,
            )
        try:
            limit = parse_size(size)
        except ValueError as exc:
            _fail(f"--case {case!r}: {exc}", EXIT_USAGE)
        parsed.append(
            (
                None if shape == "default" else shape,
                limit,
                max_model_len,
                max_running_requests,
                max_prefill_tokens,
            )
        )

    import torch

    if not torch.cuda.is_available():
        _fail(
            "bench memory needs a CUDA device (it measures real allocator peaks); without "
            "one, `headroom plan --device-total 6GiB` prints the plan of a simulated card",
            EXIT_USAGE,
        )
    from engine.commands.bench_memory import run_bench_memory

    run_bench_memory(parsed)


if __name__ == "__main__":
    main()
