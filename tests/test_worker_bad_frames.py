"""A frame the worker cannot decode as a message costs one request, not the worker: a
GenerateRequest whose prompt holds a JSON ``true`` (once let through by the service's
checks, it took the worker down twice, every other client getting 503) comes back as a
:class:`Rejected` of that request (a 400 for its client), and the worker reads on."""

from __future__ import annotations

import msgspec

from engine.wire.ipc import Rejected, decode_to_worker, encode
from engine.wire.messages import AbortRequest, GenerateRequest, SamplingParams
from engine.worker.process import _receive


def _bad_request(request_id: str) -> bytes:
    # Built in Python, a Struct is not validated: the bool goes out as msgpack's true.
    return encode(GenerateRequest(request_id=request_id, prompt_token_ids=[1, True], sampling=SamplingParams()))


def test_a_request_of_the_wrong_types_decodes_as_its_rejection():
    got = decode_to_worker(_bad_request("r-1"))
    assert isinstance(got, Rejected)
    assert (got.request_id, got.code) == ("r-1", "invalid_request")
    assert "prompt_token_ids" in got.message


def test_a_bad_frame_naming_no_request_is_dropped_and_a_good_one_decodes():
    bad = msgspec.msgpack.encode({"type": "ResizePool", "num_pages": "many"})
    assert decode_to_worker(bad) is None
    assert decode_to_worker(encode(AbortRequest(request_id="a"))) == AbortRequest(request_id="a")


class _Pipe:
    def __init__(self, frames: list[bytes]) -> None:
        self.frames, self.sent = frames, []

    def recv_bytes(self) -> bytes:
        return self.frames.pop(0)

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.frames)

    def send(self, message) -> None:
        self.sent.append(message)


class _Engine:
    def __init__(self) -> None:
        self.added, self.aborted = [], []

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_the_worker_rejects_the_bad_frame_and_handles_the_next():
    good = encode(GenerateRequest(request_id="ok", prompt_token_ids=[1, 2], sampling=SamplingParams()))
    pipe, engine = _Pipe([_bad_request("bad"), good, encode(AbortRequest(request_id="x"))]), _Engine()
    assert _receive(pipe, engine, beats=None, planned_pages=0) is None  # no exit code: it runs on
    assert [type(m) for m in pipe.sent] == [Rejected] and pipe.sent[0].request_id == "bad"
    assert engine.added == ["ok"] and engine.aborted == ["x"]
