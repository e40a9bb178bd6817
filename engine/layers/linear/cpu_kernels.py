"""The C CPU kernels (:mod:`kernels.cpu`) as the engine uses them: built into headroom's
cache folder, or None where they cannot run (then torch's kernels serve, and the reason
is logged once). The plan and the loader both ask here, so a plan prices the layout the
loader makes."""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("headroom.engine")


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded library, or None (:func:`kernels.cpu.build.why_not` says why)."""
    from engine.common.cache_dir import cache_root
    from kernels.cpu import build

    lib = build.load(str(cache_root() / "kernels"))
    if lib is None:
        why = build.why_not()
        # Asked for: said in passing; otherwise a user loses the fast path without knowing.
        level = logging.INFO if why and why.startswith("HEADROOM_CPU_KERNELS=") else logging.WARNING
        log.log(level, "CPU: torch's kernels serve, slower (the C kernels are off: %s)", why)
    return lib
