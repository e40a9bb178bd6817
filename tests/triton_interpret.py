"""Run Triton kernels on the CPU through Triton's interpreter when there is no CUDA.

Import this before anything imports ``triton``: ``TRITON_INTERPRET=1`` is read when a
kernel is decorated. The interpreter's ``int()`` of a scalar (used by ``range`` with
a runtime bound) converts a one-element array, which NumPy 2.4 and later reject;
scalars are re-read through ``.item()`` here, so loops with runtime bounds work.
"""

from __future__ import annotations

import os

import torch

INTERPRETING = not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if INTERPRETING:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # no triton: the tests that need it skip themselves
        _interp = None
    if _interp is not None and hasattr(_interp, "_patch_lang_tensor"):
        _original = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

        _interp._patch_lang_tensor = _patch_lang_tensor
