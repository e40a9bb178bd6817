"""A torch-free stand-in for engine.core.engine.Engine, for service tests that need a worker
to misbehave on cue (hang, crash at load, crash in a loop) quickly and on purpose.

Selected with ``HEADROOM_ENGINE_FACTORY=fake_engine:FakeEngine`` (``tests/`` on
PYTHONPATH). Behaviour comes from the environment, which the spawned worker inherits:

- ``HEADROOM_FAKE_MODEL_DIR``: a folder with a tokenizer (required).
- ``HEADROOM_FAKE_STEP_S``: seconds per step (default 0.01).
- ``HEADROOM_FAKE_LOAD_S``: seconds each load takes (default 0), as a large model's;
  ``@PATH``: the seconds written in the file PATH, 0 while it does not exist (a test
  slows the loads after the first).
- ``HEADROOM_FAKE_LOAD_ERROR``: raise FileNotFoundError with this text at load;
  ``@PATH``: raise CorruptWeights with the text of the file PATH once it exists (a model
  file damaged after the first load).
- ``HEADROOM_FAKE_CRASH_AT_LOAD``: exit with code 7 during load.
- ``HEADROOM_FAKE_ORPHAN``: undo the parent-death signal and hang in the load forever,
  as a worker stuck in a driver call does: it outlives a SIGKILLed service (a stale
  worker for the next start to reap).
- A request with ``seed == 778`` hangs the step loop forever (a hung worker); one with
  ``seed == 777`` does so only while the file ``HEADROOM_FAKE_MARKER`` does not exist
  (it creates it), so it hangs the first worker and runs on the next.

Each request generates its prompt's ids again, cyclically, until ``max_new_tokens``.
"""

from __future__ import annotations

import os
import sys
import time

from engine.common.errors import RequestRejected
from engine.wire.messages import EngineInfo, EngineStats, GenerateRequest, TokenOutput

HANG_ONCE_SEED = 777
HANG_ALWAYS_SEED = 778
CONTEXT = 2048


def _load_s(setting: str) -> float:
    if not setting.startswith("@"):
        return float(setting)
    path = setting[1:]
    return float(open(path).read()) if os.path.exists(path) else 0.0


class FakeEngine:
    def __init__(self, config) -> None:
        if os.environ.get("HEADROOM_FAKE_ORPHAN"):
            import ctypes

            ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
            print("fake engine: stuck in the load on purpose", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        if os.environ.get("HEADROOM_FAKE_CRASH_AT_LOAD"):
            print("fake engine: crashing at load on purpose", file=sys.stderr, flush=True)
            os._exit(7)
        time.sleep(_load_s(os.environ.get("HEADROOM_FAKE_LOAD_S", "0")))
        error = os.environ.get("HEADROOM_FAKE_LOAD_ERROR")
        if error and error.startswith("@"):
            if os.path.exists(error[1:]):
                from engine.common.load_errors import CorruptWeights

                with open(error[1:], encoding="utf-8") as damage:
                    raise CorruptWeights(damage.read())
        elif error:
            raise FileNotFoundError(error)
        self._step_s = float(os.environ.get("HEADROOM_FAKE_STEP_S", "0.01"))
        model_dir = os.environ["HEADROOM_FAKE_MODEL_DIR"]
        self.info = EngineInfo(
            model_name="fake-model",
            model_dir=model_dir,
            architecture="Fake",
            vocab_size=49152,
            max_context_tokens=CONTEXT,
            model_context_tokens=8192,
            eos_token_ids=[2],
            device="cpu",
            dtype="float32",
            page_size=16,
            num_pages=CONTEXT // 16,
            kv_cache_bytes=0,
            weight_bytes=0,
            max_prefill_tokens=2048,
            max_running_requests=64,
        )
        self._running: dict[str, list] = {}  # id -> [request, generated]
        self._aborted: list[str] = []
        self._counts = {"finished": 0, "aborted": 0}

    def add_request(self, req: GenerateRequest) -> None:
        if len(req.prompt_token_ids) >= CONTEXT:
            raise RequestRejected("too long", code="context_length_exceeded", param="messages")
        self._running[req.request_id] = [req, 0]

    def abort(self, request_id: str) -> None:
        if self._running.pop(request_id, None) is not None:
            self._aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self._running or self._aborted)

    def step(self) -> list[TokenOutput]:
        time.sleep(self._step_s)
        outs = [
            TokenOutput(request_id=r, token_ids=[], finished=True, finish_reason="abort")
            for r in self._aborted
        ]
        self._counts["aborted"] += len(self._aborted)
        self._aborted = []
        for rid, entry in list(self._running.items()):
            req, done = entry
            if self._hangs(req):
                while True:
                    time.sleep(3600)
            ids = req.prompt_token_ids
            token = ids[done % len(ids)]
            entry[1] = done + 1
            finished = entry[1] >= req.sampling.max_new_tokens
            outs.append(
                TokenOutput(
                    request_id=rid,
                    token_ids=[token],
                    finished=finished,
                    finish_reason="length" if finished else None,
                    prompt_tokens=len(ids),
                )
            )
            if finished:
                del self._running[rid]
                self._counts["finished"] += 1
        return outs

    @staticmethod
    def _hangs(req: GenerateRequest) -> bool:
        seed = req.sampling.seed
        if seed == HANG_ALWAYS_SEED:
            return True
        marker = os.environ.get("HEADROOM_FAKE_MARKER")
        if seed == HANG_ONCE_SEED and marker and not os.path.exists(marker):
            open(marker, "w").close()
            return True
        return False

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=0,
            free_pages=self.info.num_pages,
            total_pages=self.info.num_pages,
            cached_pages=0,
            prefix_hit_tokens=0,
            prefix_lookup_tokens=0,
            finished=self._counts["finished"],
            aborted=self._counts["aborted"],
            failed=0,
        )


class ImportProbe:
    """Fails to load on purpose, reporting which service-side packages the worker
    process has imported (it must have none of them)."""

    def __init__(self, config) -> None:
        loaded = sorted(m for m in ("litestar", "uvicorn", "httpx") if m in sys.modules)
        raise RuntimeError(f"import probe: service packages in the worker: {loaded or 'none'}")
