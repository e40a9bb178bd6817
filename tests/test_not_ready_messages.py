"""What a request refused while no worker serves is told (:class:`NotReady`): the state
and its reason, each said once."""

from __future__ import annotations

from service.common.engine_states import NotReady, State
from service.supervision.unloading import pause_reason


def test_a_paused_engine_is_named_once_with_how_to_resume_it():
    for load_on_request in (False, True):
        message = NotReady(State.PAUSED, 60, pause_reason(load_on_request)).message
        assert message.startswith("the engine is paused through the control API; POST /api/control/resume "
                                  "resumes it"), message
        assert message.count("paused") == 1 and message.count("/api/control/resume") == 1, message
        assert message.endswith("; retry in 60 s"), message
    # Without a reason the state says how to resume it all the same.
    bare = NotReady(State.PAUSED, None, None).message
    assert bare == "the engine is paused (POST /api/control/resume resumes it)"
    assert NotReady(State.IDLE, 5, "unloaded after 300 s without requests").message == (
        "the engine is unloaded after 300 s without requests; retry in 5 s")
    assert NotReady(State.FAILED, None, "the worker crashed 5 times").message == (
        "the engine has failed: the worker crashed 5 times")
