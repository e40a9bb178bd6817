"""The one module that reads headroom's environment variables (``HEADROOM_*``).

Two kinds:

- options (:mod:`engine.common.options`): ``HEADROOM_`` + an option's name in capitals.
  :func:`variables` hands them to the service's settings (``service.common.settings_sources.resolve``
  merges them with the config file and the flags); :func:`kernel_switches` reads the
  kernel switches alone, for the benchmark scripts run without the ``headroom`` CLI.
- settings that are only ever variables, declared below with their help
  (:data:`ENV_ONLY`): where headroom keeps its files, and the hooks tests use.

Other programs' variables (``CUDA_VISIBLE_DEVICES``, ``TRITON_INTERPRET``,
``XDG_RUNTIME_DIR``, ``CC``) are read where they are used. ``tests/test_layout.py``
checks that no other module of engine/, service/ or kernels/ reads a ``HEADROOM_``
variable.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.common.options import ENV_PREFIX


@dataclass(frozen=True)
class EnvSetting:
    """A setting only the environment gives: its variable and what it does."""

    name: str
    help: str

    def get(self, env: Mapping[str, str] | None = None) -> str | None:
        """Its value in ``env`` (the process's environment when None); None when unset
        or empty."""
        value = (os.environ if env is None else env).get(self.name)
        return value or None


CONFIG = EnvSetting(
    "HEADROOM_CONFIG",
    "The TOML config file (default: <user config dir>/headroom/config.toml); --config wins.")
CONFIG_DIR = EnvSetting(
    "HEADROOM_CONFIG_DIR",
    "Folder of headroom's config and its API token (default: the user config folder).")
LOG_DIR = EnvSetting(
    "HEADROOM_LOG_DIR", "Folder of --log-file auto's headroom.log (default: the user log folder).")
RUNTIME_DIR = EnvSetting(
    "HEADROOM_RUNTIME_DIR",
    "Folder of a running service's instance file and sockets (default: the user runtime folder).")
CACHE_DIR = EnvSetting(
    "HEADROOM_CACHE_DIR",
    "Folder of downloaded models, converted GGUFs and built CPU kernels (default: the user cache folder).")
FAULTS = EnvSetting(
    "HEADROOM_FAULTS",
    "Test hook: faults the engine injects, site:request[:times],... (engine.common.faults).")
FAULTS_DIR = EnvSetting(
    "HEADROOM_FAULTS_DIR", "Test hook: a folder whose NAME.fault files arm faults at runtime.")
ENGINE_FACTORY = EnvSetting(
    "HEADROOM_ENGINE_FACTORY", "Test hook: module:callable building the engine in the worker (a fake one).")

ENV_ONLY: tuple[EnvSetting, ...] = (CONFIG, CONFIG_DIR, LOG_DIR, RUNTIME_DIR, CACHE_DIR, FAULTS, FAULTS_DIR,
                                    ENGINE_FACTORY)

# HEADROOM_* variables read outside the engine and the service: by the tests (their fake
# engine's HEADROOM_FAKE_*, the fuzz test's and the GPU tests') and by ui-bridge's
# browser tests. Known, so that :func:`unknown_variables` does not take them for typos.
OTHER_KNOWN: tuple[str, ...] = ("HEADROOM_FUZZ_CASES", "HEADROOM_TEST_GGUF", "HEADROOM_URL", "HEADROOM_TOKEN")
OTHER_KNOWN_PREFIXES: tuple[str, ...] = ("HEADROOM_FAKE_",)

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def variables() -> dict[str, str]:
    """Every ``HEADROOM_*`` variable of the process's environment, name -> value."""
    return {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}


def unknown_variables(
    known: Iterable[str], env: Mapping[str, str] | None = None
) -> list[tuple[str, str | None]]:
    """Each ``HEADROOM_*`` variable of ``env`` (the process's environment when None) that
    is none of ``known`` (the options' variables), :data:`ENV_ONLY` or :data:`OTHER_KNOWN`
    (nor starts with one of :data:`OTHER_KNOWN_PREFIXES`), sorted, with the closest known
    name (None when none is close): a misspelling headroom would otherwise ignore."""
    names = {*known, *(s.name for s in ENV_ONLY), *OTHER_KNOWN}
    env = variables() if env is None else env
    found = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in names or name.startswith(OTHER_KNOWN_PREFIXES):
            continue
        # Compared without the prefix they all share, which would make any two look alike.
        close = difflib.get_close_matches(name[len(ENV_PREFIX):], [n[len(ENV_PREFIX):] for n in names],
                                          n=1, cutoff=0.7)
        found.append((name, ENV_PREFIX + close[0] if close else None))
    return found


def kernel_switches(env: Mapping[str, str] | None = None):
    """The kernel switches (:class:`kernels.switches.KernelSwitches`) their
    ``HEADROOM_*`` variables give in ``env`` (the process's environment when None); an
    unset or empty one keeps its default. Bool switches take 1/0, true/false, yes/no,
    on/off in any case; text switches their words in any case (held in lower case,
    :meth:`engine.common.options.Option.as_word`, as serve's settings read them); count
    switches a whole number within their least value.

    Raises:
        ValueError: a value the switch does not take, naming the variable and the values
            it takes.
    """
    from engine.common.config import KernelOptions
    from engine.common.options import options_of
    from kernels.switches import KernelSwitches

    env = variables() if env is None else env
    values = {}
    for opt in options_of(KernelOptions):
        text = env.get(opt.env, "").strip()
        if not text:
            continue
        word = text.lower()
        value: object = None
        if opt.type is bool:
            value = word in _ON if word in _ON + _OFF else None
        elif opt.kind == "word":
            value = opt.as_word(text)
        elif text.isascii() and text.isdecimal():
            value = int(text)
        why = None if value is None else opt.problem(value)
        if value is None or why is not None:
            takes = ("1/0, true/false, yes/no or on/off" if opt.type is bool else ", ".join(opt.choices)
                     if opt.choices else "a whole number")
            raise ValueError(f"{opt.env}={text!r} is not a value of {opt.flag}: "
                             f"{why + '; ' if why and not opt.choices else ''}use {takes}, or unset it")
        values[opt.name] = value
    return KernelSwitches(**values)
