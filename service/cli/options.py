"""The click options of the ``headroom`` commands, each declared once.

Serve's settings (:data:`service.common.settings.OPTIONS`) become options here with their
environment variable and default in the help; other commands take a subset of them
(:func:`with_settings`), so a setting has the same flag, variable and config key
everywhere. The options of the benchmarks and ``generate`` that are not settings
(``--requests``, ``--max-tokens``, ``--device``...) are declared once below; a command
passes only what differs (its default, the line of help that says what the option
means for it).

Light at import (click only), like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from engine.common.config import KernelOptions
from engine.common.options import options_of
from service.cli.exits import EXIT_USAGE, fail
from service.common.ranges import SEED_MAX, SEED_MIN
from service.common.settings import OPTIONS, OPTIONS_BY_NAME, Option, SettingsError
from service.common.settings_sources import resolve

Decorator = Callable[[Any], Any]


def settings_option(opt: Option, *, show_env: bool = True) -> Decorator:
    """A click option for one setting of service.common.settings.OPTIONS, under its own flag
    on every command, with its environment variable and default in the help."""
    default = ", ".join(opt.default) if opt.multiple else opt.default
    shown = "unset" if default in (None, "") else default
    if opt.type is bool:  # unset (None) means the option decides by device: "auto"
        shown = "auto" if default is None else "on" if default else "off"
    env = f"env: {opt.env}; " if show_env else ""
    help_text = f"{opt.help} [{env}default: {shown}]"
    name = opt.flag[2:]
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


def with_settings(*names: str) -> Decorator:
    """Decorate a command with the settings ``names`` (serve's options: the same flags,
    help, environment variables and config keys on every command)."""

    def wrap(func: Any) -> Any:
        for name in reversed(names):
            func = settings_option(OPTIONS_BY_NAME[name])(func)
        return func

    return wrap


# The kernel switches (kernels.switches, as options: engine.common.config.KernelOptions):
# serve, generate, plan and bench engine take them all.
KERNEL_SWITCHES: tuple[str, ...] = tuple(opt.name for opt in options_of(KernelOptions))


def with_serve_options(func: Any) -> Any:
    """Every setting of service.common.settings.OPTIONS, in their order with the kernel
    switches last, so --help lists each one with its environment variable and default."""
    names = [opt.name for opt in OPTIONS if opt.name not in KERNEL_SWITCHES]
    return with_settings(*names, *KERNEL_SWITCHES)(func)


def warn_unknown_variables() -> None:
    """One line on stderr for each ``HEADROOM_*`` variable headroom does not read (a
    misspelling, as ``HEADROOM_PORTT``), naming the closest known one; the command goes on
    (another tool may set a ``HEADROOM_*`` variable of its own)."""
    from engine.common.environment import unknown_variables

    for name, close in unknown_variables(opt.env for opt in OPTIONS):
        hint = f"did you mean {close}?" if close else "`headroom serve --help` lists the variables"
        click.echo(f"headroom: warning: {name} is not a variable headroom reads ({hint}); ignored", err=True)


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML config file [env: HEADROOM_CONFIG; default: "
    "<user config dir>/headroom/config.toml].",
)


def resolve_or_fail(flags: dict[str, Any], config_path: Path | None) -> Any:
    """The resolved settings (:func:`service.common.settings_sources.resolve`), or exit 2 with the
    reason a setting is wrong."""
    try:
        return resolve(flags, config_path=config_path)
    except SettingsError as exc:
        fail(str(exc), EXIT_USAGE)


# -- options of generate and the benchmarks that are not settings -------------------------------


def model_option(help_text: str) -> Decorator:
    """``--model``: a Hugging Face folder or a .gguf file; unset, the embedded model."""
    return click.option("--model", default=None, help=help_text)


def device_option(help_text: str) -> Decorator:
    """``--device``: auto, cpu or cuda[:N] (anything else is click's usage error)."""
    from engine.common.options import device_spec

    def checked(ctx: click.Context, param: click.Parameter, value: str) -> str:
        why = device_spec(value)
        if why is not None:
            raise click.BadParameter(why)
        return value

    return click.option("--device", default="auto", show_default=True, help=help_text, callback=checked)


def count_option(*decls: str, least: int, default: int, help_text: str | None = None) -> Decorator:
    """An integer option of at least ``least`` (click's usage error below it), its default
    shown in the help; ``decls`` as click's (flags, then the parameter's name if renamed)."""
    return click.option(
        *decls, type=click.IntRange(min=least), default=default, show_default=True, help=help_text
    )


def requests_option(default: int) -> Decorator:
    """``-n/--requests`` (lands as ``num_requests``): how many requests a benchmark sends."""
    return count_option(
        "-n", "--requests", "num_requests", least=1, default=default, help_text="Requests to send."
    )


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange that also refuses nan (which compares false with both bounds,
    so FloatRange lets it through) and, unbounded, inf: click's usage error (exit 2)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def max_tokens_option(default: int, help_text: str, least: int = 1) -> Decorator:
    """``--max-tokens``: completion tokens of a request, at least ``least`` (a
    benchmark's 1; ``headroom generate`` takes the API's,
    :data:`service.common.ranges.MAX_TOKENS_MIN`)."""
    return count_option("--max-tokens", least=least, default=default, help_text=help_text)


def url_option(default: str | None, help_text: str) -> Decorator:
    """``--url``: the root URL of a running ``headroom serve`` (http or https, no path;
    a trailing ``/`` dropped). A URL with a path (``.../v1``, the OpenAI clients'
    base URL), another scheme, no host or a port outside 1-65535 is refused (exit 2)
    naming the root to give."""
    from urllib.parse import urlsplit

    def checked(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            fail(f"--url {value!r} is not an http URL; give e.g. http://127.0.0.1:8427", EXIT_USAGE)
        try:
            port = parts.port
        except ValueError:  # urlsplit's own refusal: not a number, or outside 0-65535
            port = -1
        if (port is not None and not 0 < port < 65536) or not parts.hostname:
            fail(f"--url {value!r} has no valid host and port; give e.g. http://127.0.0.1:8427", EXIT_USAGE)
        if parts.path.strip("/") or parts.query or parts.fragment:
            root = f"{parts.scheme}://{parts.netloc}"
            fail(
                f"--url {value} looks wrong: give the headroom service's root, {root}, "
                "without /v1 or any other path (the benchmark adds the API's paths)",
                EXIT_USAGE,
            )
        return f"{parts.scheme}://{parts.netloc}"

    return click.option(
        "--url", default=default, show_default=default is not None, help=help_text, callback=checked
    )


def seed_option(default: int | None, help_text: str) -> Decorator:
    """``--seed``: the seed of a sampler or of a benchmark's random choices, in the
    API's range (:mod:`service.common.ranges`)."""
    return click.option(
        "--seed",
        type=click.IntRange(SEED_MIN, SEED_MAX),
        default=default,
        show_default=default is not None,
        help=help_text,
    )
