"""Page-locked host memory of exactly the size asked for.

torch's ``Tensor.pin_memory()`` takes page-locked memory from its caching host
allocator, which rounds each allocation up to the next power of two: a Qwen3-30B-A3B
layer's Q6_K down stack (157 MiB) locks 256 MiB, and its 42 host layers' experts
(15.3 GiB) about 21 GiB, RAM that the plan does not count and that a desktop's other
programs lose. :func:`pinned_copy` instead maps anonymous memory of the tensor's own
size (page-aligned, transparent huge pages asked for where Linux offers them, so the
device maps it in fewer entries), fills it, and registers it with the CUDA driver
(``cudaHostRegister``, portable and mapped: copies from it run asynchronously, and a
kernel reads it over the bus at the host address, as from ``pin_memory``'s). The
registration ends, and the mapping goes, when the last tensor on the memory (views
included) is freed.

On Linux only: there the device reads registered memory at its host address (the
driver's ``canUseHostPointerForRegisteredMem``, which Windows' WDDM driver lacks);
elsewhere the copy is torch's ``pin_memory``.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref

import numpy as np
import torch

# madvise's advice for transparent huge pages (Linux).
_MADV_HUGEPAGE = 14
# cudaHostRegisterPortable | cudaHostRegisterMapped.
_REGISTER_FLAGS = 1 | 2


def _register(ptr: int, size: int) -> int:
    """``cudaHostRegister``'s error code (0: registered)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, size, _REGISTER_FLAGS))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class _Mapping:
    """An anonymous mapping of ``size`` bytes seen by numpy as one uint8 array (its
    ``__array_interface__``), so that the arrays and tensors made from it keep it alive."""

    def __init__(self, size: int) -> None:
        self.mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        head = ctypes.c_char.from_buffer(self.mmap)
        self.ptr = ctypes.addressof(head)
        del head  # the buffer's export ends here: the mapping can be closed later
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


def _release(mapping: mmap.mmap, ptr: int, registered: bool) -> None:
    if registered:
        _unregister(ptr)
    mapping.close()


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (any device) in page-locked host memory of exactly its
    bytes, rounded up to whole pages (module docstring).

    Falls back to ``t.pin_memory()`` off Linux and where the driver refuses the
    registration.
    """
    nbytes = t.numel() * t.element_size()
    src = t.detach().to("cpu").contiguous()
    if nbytes == 0 or sys.platform != "linux":
        return src.pin_memory()
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = _Mapping(size)
    try:  # best effort: fewer, larger pages where the kernel has them
        ctypes.CDLL(None).madvise(ctypes.c_void_p(mapping.ptr), ctypes.c_size_t(size), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    out = torch.from_numpy(np.asarray(mapping))[:nbytes].view(src.dtype).view(src.shape)
    out.copy_(src)  # the pages exist before they are locked
    registered = _register(mapping.ptr, size) == 0
    weakref.finalize(mapping, _release, mapping.mmap, mapping.ptr, registered)
    if not registered:
        return src.pin_memory()
    return out
