"""The fault hook that injects ``torch.OutOfMemoryError`` at a site of a step (prefill,
decode, sample) for a request: its spec, how it fires and counts down, and that an
engine has none unless asked. The faults' effects are tested in ``test_oom.py``.
"""

from __future__ import annotations

import pytest
import torch
from tiny_engine import tiny_engine

from engine.common.faults import ENV_VAR, FaultInjector


def test_fault_spec_parses_rules_and_refuses_bad_ones():
    inj = FaultInjector.parse("prefill:req-1:2, decode:*:1,sample:a:b:3,prefill:solo,decode:a:b")
    assert [(r.site, r.request_id, r.remaining) for r in inj.rules] == [
        ("prefill", "req-1", 2),
        ("decode", "*", 1),
        ("sample", "a:b", 3),
        ("prefill", "solo", 1),
        ("decode", "a:b", 1),  # a request id may hold ':'
    ]
    assert FaultInjector.from_env({}) is None
    assert FaultInjector.from_env({ENV_VAR: "  "}) is None
    for bad, words in [
        ("boom:x:1", "unknown fault site"),
        ("prefill", "expected site:request"),
        ("prefill:x:0", "times must be >= 1"),
        ("decode::2", "empty request id"),
        ("prefill:*:abc", "the count 'abc' is not a positive integer"),
        ("decode:req-1:1.5", "the count '1.5' is not a positive integer"),
        ("sample:*:", "the count '' is not a positive integer"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            FaultInjector.parse(bad)
        assert ENV_VAR in str(err.value)


def test_injector_fires_per_step_and_counts_down():
    inj = FaultInjector()
    inj.add("decode", "b", times=2)
    inj.add("sample", "*", times=1)
    inj.check("decode", ["a"])  # not the target
    inj.check("prefill", ["b"])  # not the site
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError, match="injected at site decode for request b"):
            inj.check("decode", ["a", "b"])
    inj.check("decode", ["b"])  # used up
    inj.check("sample", [])  # nothing samples: no match for "*"
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        inj.check("sample", ["z"])
    assert inj.pending == 0
    assert inj.fired == [("decode", "b"), ("decode", "b"), ("sample", "z")]


def test_no_injector_unless_asked(tiny_dir, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    engine = tiny_engine(tiny_dir, 96)
    assert engine.runner.faults is None  # the step pays one `is None` test
    assert engine.drain_events() == []
