"""The C CPU kernels (:mod:`kernels.cpu`) as the engine uses them: built into headroom's
cache folder, or None where they cannot run (then torch's kernels serve, and the reason
is logged once). The plan and the loader both ask here, so a plan prices the layout the
loader makes."""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("headroom.engine")


def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded library, or None (:func:`kernels.cpu.build.why_not` says why); None
    while the ``cpu_kernels`` switch (:mod:`kernels.switches`) is off."""
    from kernels.cpu.build import SWITCHED_OFF
    from kernels.switches import current

    if not current().cpu_kernels:
        _say_switched_off(SWITCHED_OFF)
        return None
    return _built()


@functools.cache
def _say_switched_off(why: str) -> None:
    """Log, once a process, that the switch keeps the C kernels off (each caller asks)."""
    log.info("CPU: torch's kernels serve (the C kernels are %s)", why)


@functools.cache
def _built() -> ctypes.CDLL | None:
    from engine.common.cache_dir import cache_root
    from kernels.cpu import build

    lib = build.load(str(cache_root() / "kernels"))
    if lib is None:
        # A user would otherwise lose the fast path without knowing.
        log.warning("CPU: torch's kernels serve, slower (the C kernels are off: %s)", build.why_not())
    return lib
