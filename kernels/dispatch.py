"""Which implementation of a kernel runs: Triton on CUDA tensors, the torch reference
otherwise.

Every kernel in :mod:`kernels` has a plain-torch reference (CPU and any device) and may
have a Triton version of the same signature. :data:`KERNELS` maps a name to the pair;
calling a :class:`Kernel` picks the Triton version when its first tensor argument is on
CUDA and ``triton`` imports, and the reference otherwise, so the CPU path never imports
Triton and stays exactly what the references compute.

The ``kernels`` switch (:mod:`kernels.switches`; ``--kernels torch``,
``HEADROOM_KERNELS=torch``) forces the references everywhere (for bisecting a numerical
difference on the GPU); it is read at each call.

The Triton modules are imported on first CUDA use, not at import time: their
``@triton.jit`` functions are built when the module loads, and the interpreter
(``TRITON_INTERPRET=1``, used by the CPU tests) is chosen at that moment.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.activation.reference import silu_and_mul as _silu_and_mul_ref
from kernels.gemv.reference import gate_up_silu as _gate_up_silu_ref
from kernels.gemv.reference import linear as _linear_ref
from kernels.moe.quant_reference import fused_moe_quant as _fused_moe_quant_ref
from kernels.moe.reference import fused_moe as _fused_moe_ref
from kernels.norm.reference import fused_add_rms_norm as _fused_add_rms_norm_ref
from kernels.norm.reference import rms_norm as _rms_norm_ref
from kernels.rotary.reference import rotary_and_store as _rotary_and_store_ref
from kernels.switches import current


def triton_available() -> bool:
    """Whether the Triton versions may run: ``triton`` imports and the ``kernels``
    switch is not ``torch``."""
    return current().kernels != "torch" and _triton_imports()


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel whose main input is ``t`` runs its Triton version."""
    return t.is_cuda and triton_available()


@dataclass(frozen=True)
class Kernel:
    """One kernel: its torch reference and where its Triton version lives.

    Attributes:
        name: the registry key.
        reference: the plain-torch implementation.
        triton_module, triton_name: module and attribute of the Triton implementation
            (same signature), imported on first CUDA use.
    """

    name: str
    reference: Callable
    triton_module: str
    triton_name: str

    def triton(self) -> Callable:
        """The Triton implementation (imports its module).

        Raises:
            ImportError: ``triton`` is not installed.
        """
        return getattr(importlib.import_module(self.triton_module), self.triton_name)

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        impl = self.triton() if use_triton(x) else self.reference
        return impl(x, *args, **kwargs)


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("rms_norm", _rms_norm_ref, "kernels.norm.triton_kernel", "rms_norm"),
        Kernel("fused_add_rms_norm", _fused_add_rms_norm_ref, "kernels.norm.triton_kernel", "fused_add_rms_norm"),
        Kernel("silu_and_mul", _silu_and_mul_ref, "kernels.activation.triton_kernel", "silu_and_mul"),
        Kernel("rotary_and_store", _rotary_and_store_ref, "kernels.rotary.triton_kernel", "rotary_and_store"),
        Kernel("linear", _linear_ref, "kernels.gemv.triton_kernel", "linear"),
        Kernel("gate_up_silu", _gate_up_silu_ref, "kernels.gemv.triton_kernel", "gate_up_silu"),
        Kernel("fused_moe", _fused_moe_ref, "kernels.moe.triton_kernel", "fused_moe"),
        Kernel("fused_moe_quant", _fused_moe_quant_ref, "kernels.moe.quant_triton_kernel", "fused_moe_quant"),
    )
}

rms_norm = KERNELS["rms_norm"]
fused_add_rms_norm = KERNELS["fused_add_rms_norm"]
silu_and_mul = KERNELS["silu_and_mul"]
rotary_and_store = KERNELS["rotary_and_store"]
linear = KERNELS["linear"]
gate_up_silu = KERNELS["gate_up_silu"]
fused_moe = KERNELS["fused_moe"]
fused_moe_quant = KERNELS["fused_moe_quant"]
