"""The control API's wire shapes, beside the event types: the bodies of
``POST /api/control/reserve`` and ``/api/control/cache`` (and the empty one of
``restart``, ``pause`` and ``resume``), what every control route
answers, and the WebSocket subprotocol that carries the local token. The routes are
:mod:`service.control.routes`; the JSON Schema export (:mod:`service.events.export_schema`)
and the OpenAPI document read these.
"""

from __future__ import annotations

import msgspec

# A browser cannot set headers on a WebSocket: the socket takes the local token as the
# subprotocol ``headroom.token.<token>`` (the server echoes it).
SUBPROTOCOL_PREFIX = "headroom.token."


class NoBody(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /api/control/restart``, ``/pause`` and ``/resume``: none, or ``{}``
    (what a JSON client sends for none); any field is refused."""


class ReserveRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /api/control/reserve``: ``reserve`` is ``"auto"``, a number of
    bytes, or a size as text (``"1.5GiB"``, ``"512MiB"``)."""

    reserve: int | float | str  # a float: the size parser names 1.5GiB


class CacheRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /api/control/cache``. ``kv_cache``: the KV pool's size (bytes or
    text such as ``"6GiB"``; null: back to the plan's size; absent: unchanged).
    ``clear_prefix_cache``: true evicts every prefix-cache page no running request holds
    (done last, after any size change: a refused size leaves the cache as it was; false,
    the default, leaves it).
    ``expert_cache``: the GPU expert cache's size, for routed experts in host memory
    (``--cpu-experts``; bytes or text, whole slots; null: the plan's size; absent:
    unchanged); done before ``kv_cache``. ``cpu_layers``: the last decoder layers the
    CPU runs (``--cpu-layers auto`` and a model that can split; null: the start's split;
    absent: unchanged); done first."""

    kv_cache: int | float | str | None | msgspec.UnsetType = msgspec.UNSET  # a float refused in words
    expert_cache: int | float | str | None | msgspec.UnsetType = msgspec.UNSET
    cpu_layers: int | None | msgspec.UnsetType = msgspec.UNSET
    clear_prefix_cache: bool = False


class ControlResponse(msgspec.Struct, kw_only=True):
    """What a control route answers: ``action`` done (``restart``, ``pause``,
    ``resume``, ``reserve``, ``cache``), and the target's ``message``."""

    ok: bool
    action: str
    message: str | None = None
