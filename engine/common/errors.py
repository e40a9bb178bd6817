"""Errors the engine raises to its caller (torch-free)."""

from __future__ import annotations


class RequestRejected(Exception):
    """A request that can never run, refused before it is queued.

    Attributes:
        code: OpenAI-style error code, e.g. ``"context_length_exceeded"``.
        param: the request field at fault, or None.
    """

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class PlanDoesNotFit(Exception):
    """The memory plan cannot hold one request of the minimum context.

    ``plan`` is the :class:`engine.memory.plan.MemoryPlan`; the message says what does
    not fit, by how much, and which settings fix it.
    """

    def __init__(self, plan) -> None:
        super().__init__(plan.message())
        self.plan = plan


# What helps when CUDA cannot start on a machine with an NVIDIA GPU (for people).
CUDA_HINTS = (
    "after a suspend and resume the NVIDIA driver often needs its UVM module reloaded "
    "(sudo rmmod nvidia_uvm && sudo modprobe nvidia_uvm); at login the driver may still "
    "be loading; a driver update needs a reboot; --device cpu runs on the CPU instead"
)


class CudaUnavailable(Exception):
    """A GPU is present or was asked for (``--device cuda``, or ``auto`` where NVML sees
    an NVIDIA GPU) but CUDA cannot be initialised; the engine never falls back to the
    CPU silently. The message says why and what helps (:data:`CUDA_HINTS`)."""


class TorchWithoutCuda(CudaUnavailable):
    """A GPU was asked for, but the installed torch is built without CUDA (or ROCm): no
    wait for the GPU can help (the service exits instead of waiting); the message names
    the install that does."""


class SettingRefused(ValueError):
    """A setting the model or the machine cannot honour (a tensor-parallel size that
    does not split the model, more ranks than GPUs, more ``--cpu-experts`` layers than
    the model has), found before anything loads; the message names the fix. A
    ``ValueError``, as any bad config value."""
