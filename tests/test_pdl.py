"""Programmatic dependent launch (:mod:`kernels.pdl`) where it cannot run: never on the
CPU or in Triton's interpreter, and only where the switch is on. (On sm_90 the
kernels' PTX holds the wait and the early launch: ``triton_compile_check.py``; the
launched step's logits equal stream order bit for bit: ``tests/gpu/test_pdl_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch

from kernels import pdl


def test_no_pdl_on_the_cpu():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": 0}


def test_the_switch_and_the_device_decide(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.launch_args(cuda) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(pdl, "PDL", False)  # HEADROOM_PDL=0
    assert pdl.launch_args(cuda) == {"PDL": 0}
    monkeypatch.setattr(pdl, "PDL", True)
    monkeypatch.setattr(pdl, "_supported", lambda index: False)  # before sm_90, or an old Triton
    assert pdl.launch_args(cuda) == {"PDL": 0}


def test_the_interpreter_never_takes_it(monkeypatch):
    pdl._supported.cache_clear()
    monkeypatch.setattr(pdl, "_INTERPRETING", True)
    try:
        assert not pdl._supported(0)
    finally:
        pdl._supported.cache_clear()


def test_a_typo_in_the_switch_is_refused(monkeypatch):
    from kernels.env import env_flag

    monkeypatch.setenv("HEADROOM_PDL", "onn")
    with pytest.raises(ValueError, match="HEADROOM_PDL='onn' is not a switch"):
        env_flag("HEADROOM_PDL", True)
