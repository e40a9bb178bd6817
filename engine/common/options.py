"""Options declared once: a frozen dataclass field plus its metadata.

An option is a field made with :func:`option`; everything a person types is derived
from it: the command-line flag (``--`` + the name with dashes), the environment
variable (``HEADROOM_`` + the name in capitals), the config file key (the name), the
``--help`` text, the value's type (the field's annotation) and its checks. The same
name is the field's name in every config down the chain (settings, engine config,
plan knobs). Torch-free and click-free: the engine's configs and the service's
settings both declare their options here, and the CLI builds its flags from
:func:`options_of`.

Sizes are bytes in the field; ``kind="size"`` (or ``"size_or_auto"``, where ``auto``
is None) says a person writes them as text such as ``6GiB`` (:mod:`engine.common.units`).
``kind="word_or_number"`` is a text field whose value is a word or a number
(``auto|none|N``, a duration such as ``5m`` or seconds): a number from the config file
(TOML ``2``, ``1.5``) becomes its text, as the command line and the environment give it.
``kind="word"`` is one of the option's ``choices`` written in any case (``AUTO``, a
TOML ``8`` for ``"8"``), held in lower case: the kernel switches' text values
(:func:`options_from`), as bool switches take ``ON`` and sizes ``6gib``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "HEADROOM_"

# The largest count (tokens, pages, requests, rows) an option takes; past it a value is a
# typo that no C integer of the engine, nor the worker's wire, holds. Sizes have theirs
# (engine.common.units.MAX_SIZE).
MAX_COUNT = 2**31 - 1

# A check returns None for a good value, else why it is not (e.g. "must be at least 1").
Check = Callable[[Any], "str | None"]

_METADATA_KEY = "headroom.option"
_NO_DEFAULT = object()


@dataclass(frozen=True)
class Option:
    """One option as the CLI, the environment and the config file see it.

    ``type`` is the type a person's text becomes before any size parsing: ``str`` for
    sizes (``kind`` set) and for the items of a repeatable option (``multiple``).
    ``default`` is as a person would write it (a size as text, such as ``"32MiB"``).
    """

    name: str
    type: type
    default: Any
    help: str
    multiple: bool = False
    kind: str | None = None  # "size" | "size_or_auto" | "word_or_number" | "word" | None
    choices: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    shown_metavar: str | None = None
    # A size written without a unit below this many bytes (but 0) is refused as a missing
    # unit (engine.common.units.parse_size); 0: any.
    unitless_min: int = 0

    @property
    def metavar(self) -> str | None:
        if self.shown_metavar:
            return self.shown_metavar
        if self.choices:
            return "|".join(self.choices)
        return {"size": "SIZE", "size_or_auto": "auto|SIZE"}.get(self.kind or "")

    def as_word(self, text: str) -> str:
        """A ``word`` option's ``text`` in lower case where that is one of its choices,
        whatever case it was written in; else as written, for the choices' check to
        refuse (:meth:`problem`). The one rule for the flag, the environment and the
        config file."""
        lower = text.strip().lower()
        return lower if lower in self.choices else text

    @property
    def is_size(self) -> bool:
        """Written as a size (``6GiB``), held in bytes."""
        return self.kind in ("size", "size_or_auto")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def problem(self, value: Any) -> str | None:
        """Why the resolved ``value`` cannot be used (None: it can). None values are
        "unset" and pass."""
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value} is not a finite number"
        if type(value) is int and not self.is_size and abs(value) > MAX_COUNT:
            return f"{value} is more than {MAX_COUNT:,}, beyond any machine; give a smaller number"
        for check in self.checks:
            why = check(value)
            if why is not None:
                return why
        return None


@dataclass(frozen=True)
class _Meta:
    help: str
    kind: str | None
    choices: tuple[str, ...]
    checks: tuple[Check, ...]
    shown_default: Any
    metavar: str | None
    unitless_min: int


def option(
    default: Any,
    help: str,
    *,
    kind: str | None = None,
    choices: tuple[str, ...] = (),
    checks: tuple[Check, ...] = (),
    shown_default: Any = _NO_DEFAULT,
    metavar: str | None = None,
    unitless_min: int = 0,
) -> Any:
    """A dataclass field that is an option.

    Args:
        default: the field's default (bytes for a size).
        help: the ``--help`` text (the CLI appends the variable and the default).
        kind: ``"size"`` or ``"size_or_auto"`` for sizes written as text,
            ``"word_or_number"`` for text that may be a number (see the module
            docstring), ``"word"`` for one of ``choices`` written in any case (held in
            lower case).
        choices: the allowed values (checked, and listed as the metavar).
        checks: more checks of the resolved value, e.g. ``at_least(1)``.
        shown_default: the default as a person writes it where it differs from the
            field's (a size in bytes shown as ``"32MiB"``).
        metavar: how ``--help`` shows the value (e.g. ``"auto|none|N"``).
        unitless_min: for a size, the least bytes a number without a unit may give (but
            0): where no one means a few bytes (``--reserve 2``), a smaller one is refused
            as a missing unit.
    """
    if choices:
        checks = (one_of(*choices), *checks)
    meta = _Meta(help, kind, choices, checks, default if shown_default is _NO_DEFAULT else shown_default,
                 metavar, unitless_min)
    if isinstance(default, (list, dict, set)):
        raise TypeError("an option's default must be immutable (use a tuple)")
    return dataclasses.field(default=default, metadata={_METADATA_KEY: meta})


@functools.cache
def options_of(cls: type) -> tuple[Option, ...]:
    """The options of a dataclass, in field order (a subclass's after its base's)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_METADATA_KEY)
        if meta is None:
            continue
        value_type, multiple = _value_type(hints[f.name])
        found.append(
            Option(
                name=f.name,
                type=str if meta.kind else value_type,
                default=meta.shown_default,
                help=meta.help,
                multiple=multiple,
                kind=meta.kind,
                choices=meta.choices,
                checks=meta.checks,
                shown_metavar=meta.metavar,
                unitless_min=meta.unitless_min,
            )
        )
    return tuple(found)


def options_from(plain: type, name: str, module: str) -> type:
    """A frozen dataclass ``name`` (of ``module``, for pickling and docs) with one option
    per field of the plain dataclass ``plain``: same name, type and default, the
    ``--help`` text, allowed values and least value from the field's metadata (``"help"``,
    ``"choices"``, ``"minimum"``). This is how a package that may not import the engine (the kernels'
    :class:`kernels.switches.KernelSwitches`) declares options: a config inherits the
    result, and :func:`pick` takes the values back into ``plain``.

    Raises:
        KeyError: a field without ``"help"`` in its metadata.
    """
    hints = typing.get_type_hints(plain)

    def made_option(f: dataclasses.Field) -> Option:
        low, choices = f.metadata.get("minimum"), tuple(f.metadata.get("choices", ()))
        # A text switch's values are words: any case from every source, held in lower case.
        return option(f.default, f.metadata["help"], choices=choices, kind="word" if choices else None,
                      checks=() if low is None else (at_least(low),))

    fields = [(f.name, hints[f.name], made_option(f)) for f in dataclasses.fields(plain)]
    made = dataclasses.make_dataclass(name, fields, frozen=True)
    made.__module__ = module
    made.__doc__ = f"The options of :class:`{plain.__module__}.{plain.__qualname__}` (one per field)."
    return made


def option_named(cls: type, name: str) -> Option:
    """The option ``name`` of ``cls``.

    Raises:
        KeyError: ``cls`` has no such option.
    """
    for opt in options_of(cls):
        if opt.name == name:
            return opt
    raise KeyError(name)


def _value_type(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, False); ``tuple[str, ...]`` -> (str, True)."""
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return args[0], False
    return hint, False


def pick(source: Any, cls: type, **overrides: Any) -> Any:
    """An instance of dataclass ``cls`` with each field taken from the same-named
    attribute of ``source`` (fields ``source`` lacks keep their defaults); ``overrides``
    win. This is how a config passes its values down the chain: same names, no copy
    lists."""
    values = {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(cls)
        if f.init and hasattr(source, f.name)
    }
    values.update(overrides)
    return cls(**values)


# -- checks ----------------------------------------------------------------------------


def at_least(low: float, note: str | None = None, *, shown: str | None = None) -> Check:
    """``value >= low``; the message reads "must be at least LOW (NOTE)"."""
    text = f"must be at least {shown or low}" + (f" ({note})" if note else "")
    return lambda value: None if value >= low else text


def positive(value: Any) -> str | None:
    """``value > 0``."""
    return None if value > 0 else "must be positive"


def nonzero_size(value: Any) -> str | None:
    """A size that is not 0 bytes."""
    return None if value != 0 else "must be more than 0 bytes"


def in_range(low: int, high: int, what: str) -> Check:
    """``low <= value <= high``; the message reads "VALUE is not WHAT (LOW-HIGH)"."""
    return lambda value: None if low <= value <= high else f"{value} is not {what} ({low}-{high})"


def device_spec(value: Any) -> str | None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (torch's own spelling of a CUDA device)."""
    text = str(value)
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdecimal()):
        return None
    return f"{value!r} is not a device: use auto, cpu, cuda or cuda:N (N a GPU's index)"


def one_of(*choices: str, ignore_case: bool = False) -> Check:
    """``value`` is one of ``choices`` (optionally in any case)."""

    def check(value: Any) -> str | None:
        seen = str(value).lower() if ignore_case else value
        if seen in choices:
            return None
        close = difflib.get_close_matches(str(value).strip().lower(), choices, n=1, cutoff=0.6)
        return f"{value!r} is not one of {', '.join(choices)}" + (f"; did you mean {close[0]}?" if close else "")

    return check


def auto_or_count(*words: str, what: str = "layers") -> Check:
    """A check for ``auto``, any of ``words`` or a whole number of at least 0
    (``--cpu-experts``: ``auto|none|N``, ``--cpu-layers``: ``auto|N``); ``what`` names the
    number's unit in the refusal."""
    allowed = ("auto", *words)

    def check(value: str) -> str | None:
        if value in allowed:
            return None
        if value.isascii() and value.isdecimal():  # not "０" or "١"
            # A model has at most thousands of layers; a longer number is a slip.
            return None if len(value) <= 6 else f"{value} is more {what} than any model has"
        return f"{value!r} is not {', '.join(allowed)} or a whole number of {what} (0 or more)"

    return check


def thread_count(value: str) -> str | None:
    """``auto`` or a whole number from 1 to the cores this process may use
    (``--cpu-threads``): more threads than cores make every op wait for a time slice,
    and with hundreds of them a step outlasts the watchdog."""
    if value == "auto":
        return None
    if not (value.isascii() and value.isdecimal() and int(value) >= 1):
        return f"{value!r} is not auto or a number of threads (1 or more)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if int(value) > cores:
        return f"{value} is more than the {cores} cores this process may use; use auto or 1-{cores}"
    return None
