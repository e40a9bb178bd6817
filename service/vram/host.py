"""The host's memory, for the dashboard and the tray where there is no GPU to watch.

In CPU mode the engine's weights and KV cache live in the host's RAM, so that is the
memory a person wants to see. :func:`host_memory` reads it with psutil (Linux, macOS
and Windows alike): the machine's total, what is available to new allocations without
swapping (psutil's ``available``: the kernel's ``MemAvailable`` on Linux), and the
resident set of this service's processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import psutil

from service.events.schemas import HostMemory

# Seconds between host samples in CPU mode: RAM moves slowly next to a GPU's memory.
HOST_SAMPLE_S = 1.0


def host_memory(own_pids: Iterable[int]) -> HostMemory:
    """The host's memory now, in bytes; ``ours_bytes`` sums the resident set of
    ``own_pids`` (a pid that is gone or not ours to read counts 0)."""
    vm = psutil.virtual_memory()
    ours = 0
    for pid in set(own_pids):
        with contextlib.suppress(psutil.Error):
            ours += psutil.Process(pid).memory_info().rss
    return HostMemory(total_bytes=int(vm.total), available_bytes=int(vm.available), ours_bytes=ours)
