"""How many OpenMP threads a C kernel call takes."""

from __future__ import annotations

import os

import torch


def default_threads() -> int:
    """OpenMP threads for a call: torch's intra-op count (what the engine fits to the cores
    other programs leave free between steps), never above the cores this process may run
    on (``os.sched_getaffinity``; torch's own default counts the machine's)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), usable))
