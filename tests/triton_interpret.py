"""Where the Triton kernel tests run: compiled on CUDA when there is a GPU, else in
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``).

Import this before anything imports ``triton``: ``TRITON_INTERPRET=1`` is read when a
kernel is decorated (``conftest.py`` sets it too, before any test module is imported).
The interpreter's ``int()`` of a scalar (used by ``range`` with a runtime bound)
converts a one-element array, which NumPy 2.4 and later reject; scalars are re-read
through ``.item()`` here, so loops with runtime bounds work.
"""

from __future__ import annotations

import os

import pytest
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


def kernel_device() -> str:
    """``"cuda"`` or ``"cpu"`` (interpreted); skips the test when neither can run Triton."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and triton was imported without TRITON_INTERPRET=1")
    return "cpu"
