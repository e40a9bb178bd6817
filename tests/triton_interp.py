"""Where the Triton kernel tests run: compiled on CUDA when there is a GPU, else in
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by ``conftest.py``
before triton is first imported)."""

from __future__ import annotations

import os

import pytest
import torch


def kernel_device() -> str:
    """``"cuda"`` or ``"cpu"`` (interpreted); skips the test when neither can run Triton."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and triton was imported without TRITON_INTERPRET=1")
    return "cpu"
