"""Programmatic dependent launch (PDL) between the decode step's Triton kernels.

A CUDA graph of a decode step is hundreds of short kernels in a row, and between two of
them the GPU idles: the first one's last programs drain, its writes are flushed, then
the second one's programs are scheduled and issue their first loads. With PDL (Hopper,
sm_90, and later; CUDA's ``cudaLaunchAttributeProgrammaticStreamSerialization``, Triton's
``launch_pdl``) the second kernel is launched while the first still runs, and each of
its programs waits (``griddepcontrol.wait``, :func:`wait`) only where it first reads
what an earlier kernel wrote. What comes before the wait overlaps the earlier kernel:
the int8 GEMV loads its first weight words there, which no kernel writes. A kernel
lets the next one launch early with :func:`launch_dependents` (``griddepcontrol.
launch_dependents``); one that never calls it lets it launch when its programs end.

The rules each kernel launched with :func:`launch_args` keeps, so that the order of the
stream still holds:

- every program calls :func:`wait` before it reads anything another kernel writes and
  before it writes anything (a write could race a read of the kernel before it);
- every program calls it, so the kernel completes only after the one before it has:
  a kernel after this one that waits for it also waits, transitively, for all before.

Stream capture records a PDL launch as a programmatic edge of the CUDA graph (CUDA 12.3
and later), so the replayed step keeps the overlap. The ``pdl`` switch off
(:mod:`kernels.switches`; ``--no-pdl``, ``HEADROOM_PDL=0``) launches every kernel as
before (to time the difference); Triton's interpreter and GPUs before sm_90
never use it. Sources: the PTX ISA, "griddepcontrol"; the CUDA programming guide,
"Programmatic Dependent Launch and Synchronization".
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.switches import current

try:  # Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: the kernels never take PDL
    gdc_launch_dependents = gdc_wait = None

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _supported(index: int) -> bool:
    if gdc_wait is None or _INTERPRETING:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL (module docstring; the switch
    is read at each call, so a benchmark can turn it off before capturing a graph)."""
    return current().pdl and device.type == "cuda" and _supported(device.index if device.index is not None else
                                                        torch.cuda.current_device())


def launch_args(device: torch.device) -> dict:
    """The keyword arguments of a launch of a kernel that takes a ``PDL`` constexpr:
    ``PDL=1`` and Triton's ``launch_pdl`` where :func:`enabled`, else ``PDL=0``."""
    return {"PDL": 1, "launch_pdl": True} if enabled(device) else {"PDL": 0}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernels before this one to complete and their writes to be
    visible; nothing without ``PDL``."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this (or
    ended); nothing without ``PDL``."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def begin(PDL: tl.constexpr):
    """The start of a kernel that reads its inputs at once: :func:`wait`, then
    :func:`launch_dependents` (after the wait, so at most one kernel waits ahead)."""
    wait(PDL)
    launch_dependents(PDL)
