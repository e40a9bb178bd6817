"""Faults armed while the engine runs (engine.common.faults, HEADROOM_FAULTS_DIR): a rule file
dropped in the folder is claimed once, fires at its site, and is marked fired."""

from __future__ import annotations

import pytest
import torch

from engine.common.faults import SPOOL_ENV_VAR, FaultInjector


def _spooled(tmp_path) -> FaultInjector:
    injector = FaultInjector.from_env({SPOOL_ENV_VAR: str(tmp_path)})
    assert injector is not None and injector.spool == tmp_path
    injector._next_poll = 0.0  # look now, not after the poll interval
    return injector


def test_a_dropped_rule_is_claimed_fires_once_and_is_marked(tmp_path):
    injector = _spooled(tmp_path)
    injector.check("decode", ["r1"])  # nothing armed yet
    (tmp_path / "oom-0.fault").write_text("decode:*:1\n")
    injector._next_poll = 0.0
    injector.check("prefill", ["r1"])  # claimed, but another site
    assert (tmp_path / "oom-0.taken").exists()
    with pytest.raises(torch.OutOfMemoryError, match="site decode for request r2"):
        injector.check("decode", ["r2", "r3"])
    assert (tmp_path / "oom-0.fired").exists()
    injector.check("decode", ["r2"])  # used up
    # A second injector (the next worker) does not claim it again.
    other = _spooled(tmp_path)
    other.check("decode", ["r2"])
    assert other.pending == 0


def test_a_bad_rule_file_is_set_aside(tmp_path):
    injector = _spooled(tmp_path)
    (tmp_path / "x.fault").write_text("nowhere:*:1")
    injector.check("decode", ["r1"])
    assert (tmp_path / "x.bad").exists() and injector.pending == 0


def test_without_the_variables_there_is_no_injector():
    assert FaultInjector.from_env({}) is None
