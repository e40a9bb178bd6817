"""A host function queued on a CUDA stream (``cudaLaunchHostFunc``), through ctypes on the
CUDA runtime torch loaded: the function runs on the runtime's callback thread once the
stream's work before it is done, and the stream's work after it waits for it. Queued while
a stream is captured, it becomes a host node of the graph, run at every replay.

The function must call no CUDA (the runtime forbids it in a host function) and should not
take Python's lock: :mod:`kernels.cpu.moe_job`'s ``moe_cpu_job`` is such a C function.
Where no ``libcudart`` is loaded in the process (a torch built with it static), the
driver's ``cuLaunchHostFunc`` takes the same arguments (a runtime stream is a driver
stream).
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _launcher() -> ctypes._CFuncPtr:
    """``cudaLaunchHostFunc`` of the loaded runtime, else the driver's ``cuLaunchHostFunc``.

    Raises:
        RuntimeError: neither found (no CUDA in this process).
    """
    torch.cuda.init()
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    for path, name in [*((p, "cudaLaunchHostFunc") for p in candidates), ("libcuda.so.1", "cuLaunchHostFunc")]:
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        return fn
    raise RuntimeError("no CUDA runtime or driver with a host-function launch is loaded in this process")


def launch_host_func(stream: torch.cuda.Stream, fn: int, arg: int) -> None:
    """Queue ``fn(arg)`` (a C ``void (*)(void *)``, by address) on ``stream``.

    Raises:
        RuntimeError: the launch failed (its CUDA error code).
    """
    err = _launcher()(stream.cuda_stream, fn, arg)
    if err != 0:
        raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {err}")
