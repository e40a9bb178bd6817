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


def run_compiler_script(name: str, timeout: float):
    """Run ``tests/<name>`` in a child process without ``TRITON_INTERPRET`` (Triton's
    mode is fixed when it is first imported, and this session imports it interpreted),
    the project root on ``PYTHONPATH``. Returns the ``CompletedProcess`` (text output)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name(name)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
