"""What the API's routes share: settings, the supervisor, the tokenizer side, the
admission count; and the model names a request may use (:meth:`Services.check_model`).

One :class:`Services` object per app, built by :func:`service.http.app.create_app` and
handed to route handlers by Litestar's dependency injection (parameter name ``svc``),
never through module globals. It holds shared objects only: what the engine's events
become for the UI is :mod:`service.supervision.engine_events_to_ui`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.common.clip import clip
from engine.common.model_names import model_key
from engine.loader.default_model import DEFAULT_MODEL_ALIAS
from engine.wire.messages import EngineInfo
from service.api.admission import Admission
from service.api.sampling_defaults import SamplingDefaults, load_sampling_defaults
from service.api.text import TextSide
from service.common.engine_states import UNLOADED
from service.common.errors import APIError
from service.common.settings import ServeSettings
from service.events.metrics import ServiceMetrics
from service.supervision.supervisor import Supervisor


@dataclass
class Services:
    """The app's shared objects. ``text`` is set once a worker is ready and reloaded
    only when a restarted worker serves another model folder. ``started_at`` is the
    service's start, in Unix seconds (the ``created`` of ``/v1/models``).
    ``admission`` counts the requests waiting for the engine
    (``--max-queued-requests``, :mod:`service.api.admission`). ``metrics`` is the app's
    Prometheus registry (:mod:`service.events.metrics`), which each call's end feeds."""

    settings: ServeSettings
    supervisor: Supervisor
    text: TextSide | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    started_at: int = field(default_factory=lambda: int(time.time()))
    admission: Admission = field(init=False)
    # Requests started so far (generations, Ollama's load calls): the latest one's
    # keep_alive is the model's, as in Ollama (:meth:`note_start`).
    starts: int = field(default=0, init=False)
    metrics: ServiceMetrics = field(default_factory=ServiceMetrics)
    # A tokenizer load started before the worker was ready (:meth:`prefetch`): its
    # folder and task.
    _prefetch: tuple[str, asyncio.Task[TextSide]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        limit = self.settings.max_queued_requests if self.settings is not None else 0
        self.admission = Admission(limit)

    def model_names(self, info: EngineInfo) -> list[str]:
        """Names the served model answers to: the engine's, the store name ``--model``
        gave (``owner/name[:FILE.gguf]``, when it is not a path), the configured aliases,
        then ``default`` (each once)."""
        names = [info.model_name]
        model = self.settings.model
        if model and model != info.model_name and not Path(model).expanduser().exists():
            names.append(model)
        names += [*self.settings.served_model_name, DEFAULT_MODEL_ALIAS]
        return list(dict.fromkeys(names))

    def check_model(self, requested: str | None, info: EngineInfo) -> str:
        """The model name to report for a request naming ``requested``.

        An absent or empty name, or ``"default"``, means the served model (there is
        only one). Names compare by :func:`engine.common.model_names.model_key`, Ollama's
        rule, on every API: a client that found the name in ``/api/tags`` calls ``/v1`` with it.

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        names = self.model_names(info)
        # "default" always names the one served model: the README's and most clients'
        # first request, before anyone has read /v1/models.
        if not requested or model_key(requested) in {model_key(n) for n in names}:
            return names[0]
        raise APIError(
            404,
            f"The model `{clip(requested)}` does not exist; this server serves "
            + ", ".join(f"`{n}`" for n in names),
            param="model",
            code="model_not_found",
        )

    def note_start(self) -> int:
        """Count a request as started (a generation, or a call that loads the model) and
        return its number: a pending ``keep_alive`` 0 unload stands only while its own
        request is the latest started (:func:`service.api.ollama.loading.unload_after`)."""
        self.starts += 1
        return self.starts

    def prefetch(self, model_dir: str) -> None:
        """Called by the supervisor when a loading worker names its model's folder
        (before the weights load): start loading that tokenizer now, in a thread, so
        :meth:`prepare` finds it loaded. Nothing when it is the one held already."""
        if self.text is not None and self.text.model_dir == model_dir:
            return
        if self._prefetch is not None and self._prefetch[0] == model_dir:
            return
        task = asyncio.ensure_future(TextSide.load(model_dir))
        # A load whose worker never becomes ready is never awaited: its error is read
        # here so that it is not reported as never retrieved (prepare raises its own).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._prefetch = (model_dir, task)

    async def tokenizer_info(self) -> EngineInfo:
        """The engine's facts for work done by the tokenizer alone (counting a
        prompt's tokens): a ready worker's; while no worker runs (``paused``, ``idle``,
        waiting for memory or the GPU), the last worker's, its tokenizer still held,
        so nothing loads and an idle model stays unloaded.

        Raises:
            NotReady: as :meth:`~service.supervision.readiness.Readiness.ready`, when
                the state is another or no worker was ever ready (no tokenizer held:
                it loads with the first worker).
        """
        sup = self.supervisor
        held = sup.info is not None and self.text is not None and self.text.model_dir == sup.info.model_dir
        if sup.state in UNLOADED and held:
            return sup.info
        return await sup.ready()

    async def _load_text(self, model_dir: str) -> TextSide:
        """``model_dir``'s tokenizer: the prefetched one when it was for this folder
        (its error raised here, as a load's would be), else loaded now."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None:
            if prefetch[0] == model_dir:
                return await prefetch[1]
            prefetch[1].cancel()  # another folder's: the worker that asked is gone
        return await TextSide.load(model_dir)

    async def prepare(self, info: EngineInfo) -> None:
        """Called by the supervisor when a worker is ready: load its tokenizer (or take
        the one :meth:`prefetch` began) and its sampling defaults
        (:mod:`service.api.sampling_defaults`)."""
        if self.text is None or self.text.model_dir != info.model_dir:
            old, self.text = self.text, await self._load_text(info.model_dir)
            self.sampling_defaults = await asyncio.to_thread(
                load_sampling_defaults, info.model_dir
            )
            if old is not None:
                old.close()
