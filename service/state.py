"""What the routes share: settings, the supervisor, the tokenizer side.

One :class:`Services` object per app, handed to route handlers by Litestar's
dependency injection (parameter name ``svc``), never through module globals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.messages import EngineInfo
from service.errors import APIError
from service.settings import ServeSettings
from service.supervisor import Supervisor
from service.text import TextSide


@dataclass
class Services:
    """The app's shared objects. ``text`` is set once a worker is ready and reloaded
    only when a restarted worker serves another model folder. ``started_at`` is the
    service's start, in Unix seconds (the ``created`` of ``/v1/models``)."""

    settings: ServeSettings
    supervisor: Supervisor
    text: TextSide | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    def model_names(self, info: EngineInfo) -> list[str]:
        """Names the served model answers to: the engine's, then configured aliases."""
        return [info.model_name, *self.settings.served_model_name]

    def check_model(self, requested: str | None, info: EngineInfo) -> str:
        """The model name to report for a request naming ``requested``.

        An absent or empty name means the served model (there is only one).

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        names = self.model_names(info)
        if not requested or requested in names:
            return names[0]
        raise APIError(
            404,
            f"The model `{requested}` does not exist; this server serves "
            + ", ".join(f"`{n}`" for n in names),
            param="model",
            code="model_not_found",
        )

    async def prepare(self, info: EngineInfo) -> None:
        """Called by the supervisor when a worker is ready: load its tokenizer."""
        if self.text is None or self.text.model_dir != info.model_dir:
            old, self.text = self.text, await TextSide.load(info.model_dir)
            if old is not None:
                old.close()
