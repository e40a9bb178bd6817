"""Switches the kernels read from the environment (``HEADROOM_QUANT_INT8``, ...): kernel
choices to compare in benchmarks, not options of the service, so they are not in
``headroom serve --help``; a value that is not a switch is refused, not read as on."""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: ``default`` when unset or empty.

    Raises:
        ValueError: a value other than 1/0, true/false, yes/no, on/off (any case); the
            message names the variable and the accepted values.
    """
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a switch: use 1/0, true/false, yes/no or on/off, "
                     f"or unset it (default {'on' if default else 'off'})")
