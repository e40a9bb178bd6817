"""Where ``headroom serve``'s settings come from, later winning: the defaults, the config
file, the environment, the flags (:func:`resolve`); then each option's own checks and
the rules between options.

The config file is TOML at ``platformdirs.user_config_dir("headroom")/config.toml``
(``--config`` or ``HEADROOM_CONFIG`` point elsewhere); its keys sit at the top level or
under a ``[serve]`` table. The environment variable of an option is ``HEADROOM_`` + its
name in capitals. List settings take a list in TOML and comma-separated text in the
environment; sizes are text everywhere (:func:`engine.common.units.parse_size`). The
options themselves are declared in :mod:`service.common.settings`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from engine.common import environment
from engine.common.options import Option
from engine.common.units import parse_size
from service.common.settings import (
    OPTIONS,
    OPTIONS_BY_NAME,
    ServeSettings,
    SettingsError,
    parse_duration,
)

# The tables a config file may hold; its keys sit at the top level or in one of these.
CONFIG_TABLES: tuple[str, ...] = ("serve",)


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """``config.toml`` in the user's headroom config folder (``HEADROOM_CONFIG_DIR`` in
    ``env``, the process's environment when None; else platformdirs' ``<user config
    dir>/headroom``), where the local token lives too."""
    from service.common.paths import config_dir

    return config_dir(env) / "config.toml"


def _convert(option: Option, value: Any, source: str, from_env: bool = False) -> Any:
    """Coerce a value from the file (typed) or the environment (text, ``from_env``). A
    list's empty items are dropped from a variable (``a,b,``; an empty variable is no
    value), kept from the file, where the option's checks refuse them as the flag's do."""
    if option.multiple:
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",")]
        elif isinstance(value, list):
            items = value
        else:
            raise SettingsError(f"{source}: {option.name} must be a list of strings")
        return tuple(_convert_one(option, v, source) for v in items if v != "" or not from_env)
    return _convert_one(option, value, source)


def _convert_size(option: Option, value: Any, source: str) -> int | None:
    """A size option's value (text or bytes) as bytes; ``"auto"`` is None where allowed.

    Raises:
        SettingsError: not a size, naming the source (the flag, the variable or the file).
    """
    if value is None:
        return None
    if option.kind == "size_or_auto" and isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return parse_size(value, unitless_min=option.unitless_min)
    except ValueError as exc:
        text = str(exc)
        if option.kind == "size_or_auto":
            text = text.replace("; write ", "; write auto or ")
        raise SettingsError(f"{_where(option, source)}: {text}") from None


def _convert_word_or_number(option: Option, value: Any, source: str) -> str | None:
    """A ``word_or_number`` option's value as its text: TOML's ``2`` or ``1.5`` become
    ``"2"`` or ``"1.5"``, as the command line and the environment spell them.

    Raises:
        SettingsError: neither text nor a number (a bool, a list...), naming the source.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise SettingsError(f"{_where(option, source)}: {_as_written(value)} is neither text nor a number{_takes(option)}")


def _where(option: Option, source: str) -> str:
    """Where a value came from, naming the option once: the flag alone, else the
    source and the option's name."""
    return source if source == option.flag else f"{source}: {option.name}"


def _convert_kind(option: Option, value: Any, source: str) -> Any:
    """A value of an option with a ``kind`` (a size, a word or number, a word) as the
    field holds it (a ``word`` by :meth:`Option.as_word`)."""
    if option.kind == "word_or_number":
        return _convert_word_or_number(option, value, source)
    if option.kind == "word":
        word = _convert_word_or_number(option, value, source)
        return None if word is None else option.as_word(word)
    return _convert_size(option, value, source)


def _convert_one(option: Option, value: Any, source: str) -> Any:
    if option.kind is not None:
        return _convert_kind(option, value, source)
    kind = option.type
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            if text == "auto" and option.default is None:
                return None
            raise ValueError(value)
        if kind is int and isinstance(value, (bool, float)):
            raise ValueError(value)
        if kind is str and not isinstance(value, str):
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise SettingsError(
            f"{source}: {option.name} = {_as_written(value)} is not a valid {_KIND_NAMES.get(kind, kind.__name__)}"
            f"{_takes(option)}"
        ) from None


def _takes(option: Option) -> str:
    """What to write instead of a value of the wrong kind: the choices (quoted, as a
    config file spells them), else the kind's form."""
    if option.choices:
        return f" (use one of {', '.join(json.dumps(c) for c in option.choices)})"
    if option.kind is not None:
        return f' (use a number, or a word in quotes: {option.name} = "...")'
    if option.type is bool:
        return " (use true/false, on/off, yes/no or 1/0" + (" or auto" if option.default is None else "") + ")"
    return {str: f' (write it in quotes: {option.name} = "...")', int: " (use a whole number, e.g. 4)",
            float: " (use a number, e.g. 0.5)"}.get(option.type, "")


# The kinds of values as a config file's reader knows them (TOML's names).
_KIND_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _as_written(value: Any) -> str:
    """``value`` as TOML writes it (``true``, ``"text"``, ``3``), the way the user wrote it
    in a config file (flags and environment variables give text, shown quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings in a TOML file (top level merged with ``[serve]``), by option name.

    Raises:
        SettingsError: unreadable, not UTF-8 or invalid TOML, an unknown table, an
            unknown key, or a setting written twice (at the top level and in
            ``[serve]``, or as ``max-model-len`` and ``max_model_len``); one line naming
            the file.
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(
            f"config file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    for name, value in data.items():
        if isinstance(value, dict) and name not in CONFIG_TABLES:
            raise SettingsError(
                f"config file {path}: unknown table [{name}]; known: "
                + ", ".join(f"[{t}]" for t in CONFIG_TABLES)
                + " (or the keys at the top level)"
            )
    places = [("the top level", {k: v for k, v in data.items() if not isinstance(v, dict)})]
    places += [(f"[{t}]", data[t]) for t in CONFIG_TABLES if isinstance(data.get(t), dict)]
    merged: dict[str, Any] = {}
    written: dict[str, str] = {}  # option name -> where and how the file spells it
    for place, table in places:
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in OPTIONS_BY_NAME:
                raise SettingsError(
                    f"config file {path}: unknown setting {key!r}; known: "
                    + ", ".join(o.name for o in OPTIONS)
                )
            if name in written:
                raise SettingsError(
                    f"config file {path}: {name} is set twice, as {written[name]} and as {key} "
                    f"in {place}; keep one of them"
                )
            written[name] = f"{key} in {place}"
            merged[name] = value
    return merged


def resolve(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> ServeSettings:
    """Merge the sources, later winning: defaults, config file, environment, flags.

    Args:
        flags: option name -> value from the command line; None (or an empty tuple
            for repeatable options) means "not given".
        env: the environment (the process's ``HEADROOM_*`` variables when None,
            :func:`engine.common.environment.variables`).
        config_path: the TOML file; None means ``HEADROOM_CONFIG`` or the default
            path. A missing default file is fine; a missing explicit one is an error.

    Raises:
        SettingsError: a bad value, naming where it came from.
    """
    env = environment.variables() if env is None else env
    explicit = config_path is not None or bool(environment.CONFIG.get(env))
    path = config_path or Path(environment.CONFIG.get(env) or default_config_path(env))
    file_values: dict[str, Any] = {}
    if path.exists():
        file_values = read_config_file(path)
    elif explicit:
        # The absolute path: a relative one depends on a working directory the reader
        # may not share (a service's, a script's).
        raise SettingsError(f"config file {path.absolute()} does not exist")

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        value, source = opt.default, "default"
        # The file's and the environment's values are checked even where a later source
        # wins: either is the user's mistake, to be named before it bites another run.
        if opt.name in file_values:
            value = _checked(opt, _convert(opt, file_values[opt.name], f"config file {path}"),
                             f"{opt.flag} ({path})")
            source = str(path)
        if opt.env in env and env[opt.env] != "":
            value, source = _from_environment(opt, env[opt.env]), opt.env
        flag_value = flags.get(opt.name)
        if flag_value is not None and flag_value != ():
            value = tuple(flag_value) if opt.multiple else flag_value
            source = opt.flag
            if opt.kind is not None:
                value = _convert_kind(opt, value, opt.flag)
        elif opt.kind is not None and source == "default":
            value = _convert_kind(opt, value, "default")
        values[opt.name] = value
        sources[opt.name] = source
    factory = environment.ENGINE_FACTORY.get(env)
    if factory:
        values["engine_factory"] = factory
    settings = ServeSettings(**values, sources=sources)
    _validate(settings)
    return settings


def _from_environment(option: Option, text: str) -> Any:
    """The value of ``option``'s ``HEADROOM_*`` variable, converted and checked.

    Raises:
        SettingsError: naming the variable, as its ``variable`` too.
    """
    try:
        return _checked(option, _convert(option, text, f"environment {option.env}", from_env=True),
                        f"{option.flag} ({option.env})")
    except SettingsError as exc:
        raise SettingsError(str(exc), option.env) from None


def _checked(option: Option, value: Any, where: str) -> Any:
    """``value`` once its option's own checks (:meth:`Option.problem`) pass.

    Raises:
        SettingsError: the check's reason, after ``where`` (the flag and the file or
            variable that gave the value, as :func:`_validate` names them).
    """
    why = option.problem(value)
    if why is not None:
        raise SettingsError(f"{where}: {why}")
    return value


def _validate(s: ServeSettings) -> None:
    """Each option's own checks (declared with it), then the rules between options."""

    def fail(name: str, why: str) -> None:
        flag, source = OPTIONS_BY_NAME[name].flag, s.sources[name]
        # A value from the flag itself names the flag once; one from elsewhere says where.
        where = flag if source == flag else f"{flag} ({source})"
        raise SettingsError(f"{where}: {why}", source if source == OPTIONS_BY_NAME[name].env else None)

    for opt in OPTIONS:
        why = opt.problem(getattr(s, opt.name))
        if why is not None:
            fail(opt.name, why)
    problem = s.problem()
    if problem is not None:
        fail(*problem)
    if s.vram_source == "simulated" and s.device_total is None and s.vram_timeline is None:
        fail("vram_source", "simulated needs --device-total (or a --vram-timeline with a total)")
    if s.vram_timeline is not None and s.vram_source != "simulated":
        fail("vram_timeline", "needs --vram-source simulated")
    if s.replan_low is not None and s.replan_high is not None and s.replan_low >= s.replan_high:
        fail("replan_high", "must be above --replan-low")
    if s.keep_alive is not None:
        try:
            parse_duration(s.keep_alive)
        except ValueError as exc:
            fail("keep_alive", str(exc))
    if s.stall_timeout_s <= s.heartbeat_interval_s:
        fail("stall_timeout_s", "must be longer than --heartbeat-interval-s")
