"""What the API's routes need of the app's shared objects, declared here so the API
does not import the assembly above it (:class:`service.http.state.Services` is the
object the app hands in, by Litestar's dependency injection, parameter ``svc``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.wire.messages import EngineInfo
from service.api.admission import Admission
from service.api.sampling_defaults import SamplingDefaults
from service.api.text import TextSide
from service.supervision.supervisor import Supervisor


class ApiSettings(Protocol):
    """The serve settings the API reads (``--request-timeout`` in seconds, 0: none;
    ``--default-max-tokens``, 0: the rest of the context)."""

    request_timeout: float
    default_max_tokens: int


@runtime_checkable
class ApiServices(Protocol):
    """The routes' view of the app's shared objects.

    Attributes:
        settings: the serve settings (:class:`ApiSettings`).
        supervisor: the worker's keeper (readiness, the worker link's routing).
        text: the tokenizer side, set once a worker is ready.
        sampling_defaults: what an unset sampling field means for the served model.
        admission: the count of requests waiting for the engine.
        started_at: the service's start, in Unix seconds.
    """

    settings: ApiSettings
    supervisor: Supervisor
    text: TextSide | None
    sampling_defaults: SamplingDefaults
    admission: Admission
    started_at: int

    def model_names(self, info: EngineInfo) -> list[str]:
        """Every name the served model answers to, the engine's first."""
        ...

    def check_model(self, requested: str | None, info: EngineInfo) -> str:
        """The model name to answer with for ``requested``.

        Raises:
            APIError: 404 ``model_not_found``.
        """
        ...
