"""Programmatic dependent launch (:mod:`kernels.pdl`) where it cannot run: never on the
CPU or in Triton's interpreter, and only where the switch is on. (On sm_90 the
kernels' PTX holds the wait and the early launch: ``triton_compile_check.py``; the
launched step's logits equal stream order bit for bit: ``tests/gpu/test_pdl_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch

from kernels import pdl
from kernels.switches import using


def test_no_pdl_on_the_cpu():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": 0}


def test_the_switch_and_the_device_decide(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    cuda = torch.device("cuda", 0)
    with using(pdl=True):
        assert pdl.launch_args(cuda) == {"PDL": 1, "launch_pdl": True}
    with using(pdl=False):  # --no-pdl, HEADROOM_PDL=0
        assert pdl.launch_args(cuda) == {"PDL": 0}
    with using(pdl=True):
        monkeypatch.setattr(pdl, "_supported", lambda index: False)  # before sm_90, or an old Triton
        assert pdl.launch_args(cuda) == {"PDL": 0}


def test_the_interpreter_never_takes_it(monkeypatch):
    pdl._supported.cache_clear()
    monkeypatch.setattr(pdl, "_INTERPRETING", True)
    try:
        assert not pdl._supported(0)
    finally:
        pdl._supported.cache_clear()


def test_a_typo_in_the_switch_is_refused():
    from engine.common.environment import kernel_switches
    from service.common.settings import SettingsError
    from service.common.settings_sources import resolve

    with pytest.raises(ValueError, match="HEADROOM_PDL='onn' is not a value of --pdl"):
        kernel_switches({"HEADROOM_PDL": "onn"})
    with pytest.raises(SettingsError, match="environment HEADROOM_PDL: pdl = \"onn\" is not a valid boolean"):
        resolve({}, env={"HEADROOM_CONFIG": "/dev/null", "HEADROOM_PDL": "onn"})
