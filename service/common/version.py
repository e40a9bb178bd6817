"""headroom's version: the installed distribution's (pyproject.toml's ``version``);
``0.0.0`` when the code runs from a source tree that was never installed."""

from __future__ import annotations

import importlib.metadata

UNKNOWN = "0.0.0"


def headroom_version() -> str:
    try:
        return importlib.metadata.version("headroom")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN
