"""Die with the parent process: Linux's ``prctl(PR_SET_PDEATHSIG, SIGKILL)``.

A SIGKILLed parent runs no cleanup, so each child the engine starts (the worker under
the service, tensor-parallel followers under rank 0, a GGUF conversion under the
worker) asks the kernel to kill it when its parent goes. Elsewhere a closed pipe or a
failed collective ends the child instead.
"""

from __future__ import annotations

import contextlib
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies. Returns whether the
    request was made (False off Linux or where ``prctl`` cannot be called)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return True
    return False
