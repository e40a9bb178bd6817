"""The service loads the tokenizer while the worker loads the weights: the worker names
its model's folder (``ModelFolder``) before the load, the service starts the tokenizer's
load then (``Services.prefetch``) and ``Services.prepare`` takes it once the worker is
ready, instead of loading it only after ``Ready``."""

from __future__ import annotations

import asyncio
import os

from service_harness import engine_info

from engine.common.config import EngineConfig
from engine.wire import ipc
from service.api.services import Services
from service.api.text import TextSide
from service.common.settings import ServeSettings


class RecordingPipe:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(ipc.from_worker_decoder.decode(ipc.encode(message)))


def test_the_worker_names_its_model_folder_before_it_loads_the_weights(default_model_dir):
    from engine.worker.process import _make_engine

    pipe = RecordingPipe()
    engine = _make_engine(ipc.WorkerConfig(engine=EngineConfig(device="cpu"), parent_pid=os.getpid()), pipe)
    # One message, before the engine existed; the folder is the one its Ready carries.
    assert pipe.sent == [ipc.ModelFolder(model_dir=engine.info.model_dir)]
    assert os.path.isfile(os.path.join(engine.info.model_dir, "tokenizer.json"))


def test_a_stand_in_engine_factory_sends_no_folder():
    from engine.worker.process import _make_engine

    pipe = RecordingPipe()
    config = ipc.WorkerConfig(engine=EngineConfig(device="cpu"), parent_pid=os.getpid(),
                              engine_factory="copy:copy")  # any callable of the config
    assert _make_engine(config, pipe) == config.engine
    assert pipe.sent == []


def test_prepare_takes_the_tokenizer_the_prefetch_loaded(default_model_dir):
    async def run() -> None:
        services = Services(settings=ServeSettings(), supervisor=None)  # type: ignore[arg-type]
        services.prefetch(default_model_dir)
        task = services._prefetch[1]
        services.prefetch(default_model_dir)  # the same folder again: the same load
        assert services._prefetch[1] is task
        await services.prepare(engine_info(model_dir=default_model_dir))
        assert services.text is task.result() and services._prefetch is None
        services.prefetch(default_model_dir)  # the one held already: nothing to load
        assert services._prefetch is None
        services.text.close()

    asyncio.run(run())


def test_a_prefetch_for_another_folder_is_dropped_and_a_failed_one_raises(default_model_dir, tmp_path):
    async def run() -> None:
        services = Services(settings=ServeSettings(), supervisor=None)  # type: ignore[arg-type]
        services.prefetch(str(tmp_path / "gone"))  # a worker that died before Ready
        stale = services._prefetch[1]
        await services.prepare(engine_info(model_dir=default_model_dir))
        assert stale.done() and isinstance(services.text, TextSide)
        assert services.text.model_dir == default_model_dir
        services.text.close()

        broken = Services(settings=ServeSettings(), supervisor=None)  # type: ignore[arg-type]
        broken.prefetch(str(tmp_path))  # no tokenizer there
        try:
            await broken.prepare(engine_info(model_dir=str(tmp_path)))
        except Exception as exc:  # the load's own error, as without the prefetch
            assert str(tmp_path) in str(exc) or "tokenizer" in str(exc).lower(), exc
        else:
            raise AssertionError("a folder without a tokenizer loaded")

    asyncio.run(run())
