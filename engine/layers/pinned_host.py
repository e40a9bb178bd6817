"""Page-locked host memory of exactly the size asked for.

torch's ``Tensor.pin_memory()`` takes page-locked memory from its caching host
allocator, which rounds each allocation up to the next power of two: a Qwen3-30B-A3B
layer's Q6_K down stack (157 MiB) locks 256 MiB, and its 42 host layers' experts
(15.3 GiB) about 21 GiB, RAM that the plan does not count and that a desktop's other
programs lose. :func:`pinned_copy` instead maps anonymous memory of the tensor's own
size (page-aligned; transparent huge pages asked for where Linux offers them, so the
device maps it in fewer entries; not copied into a forked child), fills it, and
registers it with the CUDA driver (``cuMemHostRegister``, portable and mapped: copies
from it run asynchronously, and a kernel reads it over the bus at the host address, as
from ``pin_memory``'s). The registration ends, and the mapping goes, when the last
tensor on the memory (views included) is freed; at the interpreter's exit the driver
takes it back with the process.

Only where the device reads registered memory at its host address (the driver's
``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``: Linux on x86-64 and ARM, not WSL2's or
Windows' WDDM driver, where the kernels' address arithmetic would miss): elsewhere, or
when the driver refuses a registration (then for the rest of the process), the copy is
torch's ``pin_memory``. The driver API keeps no "last error", so a refusal leaves
nothing behind for the next CUDA call to trip on.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref

import numpy as np
import torch

# madvise's advice (Linux): transparent huge pages; not copied into a forked child.
_MADV_HUGEPAGE = 14
_MADV_DONTFORK = 10
# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP.
_REGISTER_FLAGS = 1 | 2
# CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM.
_HOST_POINTER_ATTRIBUTE = 91

# None until the first copy decides; then whether registrations are made (False after a
# refusal, or where the device cannot read registered memory at its host address).
_usable: bool | None = None


def _driver() -> ctypes.CDLL:
    """The CUDA driver, with this thread's current context the runtime's primary one
    (``cudaSetDevice`` binds it, and is allowed during a graph capture, which a
    finalizer may run in the middle of)."""
    torch.cuda.set_device(torch.cuda.current_device())
    return ctypes.CDLL("libcuda.so.1")


def _host_pointer_readable() -> bool:
    """Whether the current CUDA device reads registered host memory at its host address."""
    cuda = _driver()
    device, value = ctypes.c_int(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()) != 0:
        return False
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), _HOST_POINTER_ATTRIBUTE, device) != 0:
        return False
    return value.value == 1


def _register(ptr: int, size: int) -> int:
    """``cuMemHostRegister``'s result code (0: registered)."""
    return int(_driver().cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(size), _REGISTER_FLAGS))


def _unregister(ptr: int) -> None:
    _driver().cuMemHostUnregister(ctypes.c_void_p(ptr))


class _Mapping:
    """An anonymous mapping of ``size`` bytes seen by numpy as one uint8 array (its
    ``__array_interface__``), so that the arrays and tensors made from it keep it alive."""

    def __init__(self, size: int) -> None:
        self.mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        head = ctypes.c_char.from_buffer(self.mmap)
        self.ptr = ctypes.addressof(head)
        del head  # the buffer's export ends here: the mapping can be closed later
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


def _release(mapping: mmap.mmap, ptr: int) -> None:
    # Whatever the device still had queued on this memory was ordered before the last
    # tensor on it went (its users synchronize or record their streams).
    _unregister(ptr)
    mapping.close()


def _advise(ptr: int, size: int) -> None:
    try:
        libc = ctypes.CDLL(None)
        for advice in (_MADV_HUGEPAGE, _MADV_DONTFORK):
            libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(size), advice)
    except (OSError, AttributeError):
        pass  # best effort


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (any device) in page-locked host memory of exactly its
    bytes, rounded up to whole pages (module docstring); ``t.pin_memory()``'s where the
    registration cannot be used."""
    global _usable
    src = t.detach().to("cpu").contiguous()
    nbytes = src.numel() * src.element_size()
    if _usable is None:
        _usable = sys.platform == "linux" and _host_pointer_readable()
    if nbytes == 0 or not _usable:
        return src.pin_memory()
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = _Mapping(size)
    _advise(mapping.ptr, size)
    out = torch.from_numpy(np.asarray(mapping))[:nbytes].view(src.dtype).view(src.shape)
    out.copy_(src)  # the pages exist before they are locked
    if _register(mapping.ptr, size) != 0:
        _usable = False
        return src.pin_memory()
    release = weakref.finalize(mapping, _release, mapping.mmap, mapping.ptr)
    release.atexit = False  # at exit the process's memory goes with it
    return out
