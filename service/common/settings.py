"""``headroom serve`` settings, declared: :class:`ServeSettings` and :data:`OPTIONS`.
Where their values come from (defaults < config file < environment < flags) is
:mod:`service.common.settings_sources`.

Every setting is declared once, as a field with its metadata
(:func:`engine.common.options.option`): the engine's options on
:class:`engine.common.config.EngineConfig`, the service's own on :class:`ServeSettings`,
which extends it. :data:`OPTIONS` lists them all; the CLI builds its flags (and its
``--help``) from it, the environment variable is ``HEADROOM_`` + the name in capitals,
and the config file key is the name itself. The config file is TOML at
``platformdirs.user_config_dir("headroom")/config.toml`` (``--config`` or
``HEADROOM_CONFIG`` point elsewhere); its keys sit at the top level or under a
``[serve]`` table. List settings take a list in TOML and comma-separated text in the
environment. Sizes (``--reserve``, ``--kv-cache``...) are text everywhere: ``6GiB``,
``5.5GiB``, ``512MiB``, ``6GB`` (decimal) or a number of bytes (:func:`parse_size`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from engine.common.config import EngineConfig
from engine.common.options import (
    ENV_PREFIX as ENV_PREFIX,
)
from engine.common.options import (
    Option as Option,
)
from engine.common.options import (
    at_least,
    in_range,
    one_of,
    option,
    options_of,
    pick,
    positive,
)
from engine.common.units import KiB, MiB
from engine.common.units import (
    parse_size as parse_size,  # one table of units for the engine and the service
)
from engine.wire.ipc import ENGINE_FACTORY, WorkerConfig

DEFAULT_PORT = 8427
# An unset max_tokens: long enough for a full answer (a reasoning model's thinking
# included), short enough that a model which never says its end token stops within
# minutes on a laptop CPU instead of running to the end of its context.
DEFAULT_MAX_TOKENS = 2048
# How long a call's body may take to arrive whole once its headers have (--body-timeout):
# a client that promised more bytes than it sends is answered 408 rather than held open.
BODY_READ_TIMEOUT_S = 30.0


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float) -> float:
    """Seconds in a duration: ``30s``, ``5m``, ``1.5h``, ``250ms``, or a bare number of
    seconds (Ollama's ``keep_alive`` spellings; ``-1`` is negative: never).

    Raises:
        ValueError: anything else, with the accepted forms.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = repr(float(text)) if isinstance(text, float) else str(text)
    value = str(text).strip().lower()
    for unit in sorted(_DURATION_UNITS, key=len, reverse=True):
        if value.endswith(unit):
            number, scale = value[: -len(unit)].strip(), _DURATION_UNITS[unit]
            break
    else:
        number, scale = value, 1.0
    try:
        seconds = float(number) * scale
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):  # nan, inf and 1e400 too: "never" is -1 or unset
        raise ValueError(
            f"{text!r} is not a duration; write seconds or a number with s, m, h or ms "
            "(e.g. 30s, 5m, 1h)"
        )
    return seconds


class SettingsError(Exception):
    """A setting has a value that cannot be used; the message names its source.
    ``variable`` is the ``HEADROOM_*`` environment variable that gave the value, when
    one did (the fix is there, not in the config file)."""

    def __init__(self, message: str, variable: str | None = None) -> None:
        super().__init__(message)
        self.variable = variable


def _check_served_names(names: tuple[str, ...]) -> str | None:
    """The refusal of a ``--served-model-name`` that is empty or only a tag, else None."""
    for name in names:
        if not name.strip():
            return "is empty; give a name, or leave the flag out"
        if any(c.isspace() or not c.isprintable() for c in name):
            return f"{name!r} holds a space or a control character; give a name without them (e.g. my-model)"
        if ":" in name and not name.partition(":")[0].strip():
            return f"{name!r} is a tag without a model name; give a name before it (e.g. 'mymodel{name}')"
    return None


@dataclass(frozen=True)
class ServeSettings(EngineConfig):
    """Resolved settings of one ``headroom serve``: the engine's options (inherited
    from :class:`EngineConfig`, same names) and the service's own below. Sizes are in
    bytes, times in seconds."""

    host: str = option(
        "127.0.0.1",
        "Address to bind. Keep the loopback default unless you "
        "mean to serve other machines (then also set --allowed-host).",
    )
    port: int = option(
        DEFAULT_PORT,
        f"TCP port to listen on (default {DEFAULT_PORT}).",
        checks=(in_range(0, 65535, "a TCP port"),),
    )
    vram_source: str = option(
        "nvml",
        "Where GPU memory is read while serving: nvml (the real card; without an NVIDIA "
        "GPU or driver: CPU mode, no replans) or simulated (a card of --device-total "
        "whose other processes follow --vram-timeline).",
        choices=("nvml", "simulated"),
    )
    vram_timeline: str | None = option(
        None,
        "JSON file scripting other processes' memory on the simulated card "
        '(--vram-source simulated): {"steps": [[seconds, size], ...]} with sizes such as '
        '"1.2GiB", bytes or "40%" of the card, seconds counted from when the engine is '
        'first ready ("start": "service" counts from the service\'s start, "file:PATH" from '
        'when PATH appears), in order; a step ["file:PATH", size] begins when PATH appears; '
        'optional "total" (the card), "display" (bool), "baseline", "gpus" and "gpu_at" '
        "(seconds before which the card is absent).",
    )
    vram_hz: float = option(
        4.0,
        "GPU memory samples per second; each goes to the event socket (coalesced) and to "
        "the replan controller.",
        checks=(positive,),
    )
    replan_low: int | None = option(  # bytes
        None,
        "Low water mark of headroom (free - reserve): below it the engine gives memory "
        "back (prefill chunk, prefix cache, KV pool, then with --cpu-layers auto decoder "
        "layers to the CPU). Unset: a quarter of the plan's "
        "safety margin (128 MiB + 1% of the card).",
        kind="size",
    )
    replan_high: int | None = option(  # bytes
        None,
        "High water mark of headroom: above it for --replan-hold seconds, layers moved to "
        "the CPU come back, then the KV pool grows back toward the plan. Unset: the low "
        "mark + 256 MiB + 2% of the card.",
        kind="size",
    )
    replan_hold: float = option(
        10.0,
        "Seconds the headroom must stay above --replan-high before the pool grows back.",
        checks=(at_least(0),),
    )
    served_model_name: tuple[str, ...] = option(
        (), "Another name the model answers to in the API (repeatable).",
        # An empty name would be listed by /v1/models as a model called "", and one that is
        # only a tag (":latest") by Ollama's /api/tags as a model without a name.
        checks=(_check_served_names,),
    )
    api_key: str | None = option(
        None,
        "Require 'Authorization: Bearer KEY' on /v1 (unset: no key); generate sends it "
        "to the running service.",
        # An empty key (an empty HEADROOM_API_KEY) would turn authentication off unseen.
        checks=(lambda key: None if key.strip() else "is empty; unset it to serve without a key",),
    )
    cors_origin: tuple[str, ...] = option(
        (),
        "A browser origin to allow besides tauri://localhost, "
        "http(s)://tauri.localhost and http://localhost:1420 (repeatable; * allows "
        "all).",
    )
    allowed_host: tuple[str, ...] = option(
        (), "A Host header name to accept besides loopback names (repeatable)."
    )
    max_body_size: int = option(  # bytes
        32 * MiB,
        "Largest request body; a larger one is answered 413 before it is read "
        "(its Content-Length) or as soon as it passes the limit (chunked).",
        kind="size",
        shown_default="32MiB",
        checks=(at_least(KiB, shown="1KiB"),),
    )
    body_timeout: float = option(  # seconds
        BODY_READ_TIMEOUT_S,
        "Seconds a request body may take to arrive whole once its headers have; past it "
        "the call is answered 408 body_timeout (a Content-Length larger than the body "
        "sent).",
        checks=(positive,),
    )
    max_header_size: int = option(  # bytes
        64 * KiB,
        "Largest request line plus headers; a larger request is refused with 431 "
        "before any route runs.",
        kind="size",
        shown_default="64KiB",
        checks=(at_least(4 * KiB, shown="4KiB"),),
    )
    max_queued_requests: int = option(
        256,
        "Most API requests waiting for the engine (admitted, no token out yet); past it "
        "503 with Retry-After at once (0: no limit).",
        checks=(at_least(0, "0: no limit"),),
    )
    request_timeout: float = option(  # seconds; 0: none
        0.0,
        "Seconds a completion request may take from arrival to its last token, counting "
        "only while the engine is ready (a model load the request waits for, or a "
        "restart under it, is not its time); past it the engine drops it and the client "
        "gets a 504 request_timeout error (0: none).",
        checks=(at_least(0, "0: none"),),
    )
    default_max_tokens: int = option(
        DEFAULT_MAX_TOKENS,
        "Most tokens a chat completion (/v1/chat/completions, Ollama's /api/chat and "
        "/api/generate) generates when the request sets no max_tokens, "
        "max_completion_tokens or num_predict; never more than the context leaves after "
        "the prompt (0: the rest of the context). /v1/completions keeps OpenAI's 16.",
        checks=(at_least(0, "0: the rest of the context"),),
    )
    keep_alive: str | None = option(
        None,
        "Unload the engine after this long without requests (e.g. 30s, 5m, 1h, or "
        "seconds), giving its memory back; the next request loads it again and waits "
        "for it (state 'idle'). Unset or negative (Ollama's -1): never; 0: as soon as "
        "no request runs.",
        kind="word_or_number",
        metavar="DURATION",
    )
    load_on_request: bool = option(
        False,
        "A request to a paused engine (POST /api/control/pause) loads it again and waits "
        "for it, instead of a 503 with Retry-After.",
    )
    memory_settle: float = option(
        3.0,
        "Seconds the GPU's free memory must stay sufficient before a service waiting for "
        "memory (state 'waiting_for_memory') starts the engine.",
        checks=(at_least(0, "seconds"),),
    )
    heartbeat_interval_s: float = option(
        0.5, "Seconds between the worker's heartbeats.", checks=(positive,)
    )
    stall_timeout_s: float = option(
        30.0,
        "Seconds without a heartbeat, or without progress in a step (a long step that "
        "moves on is fine), after which a worker counts as hung and is restarted.",
        checks=(positive,),
    )
    start_timeout_s: float = option(
        900.0,
        "Seconds a worker may take to load before it is killed and restarted.",
        checks=(positive,),
    )
    max_restarts: int = option(
        5,
        "Worker exits within --restart-window-s that count as "
        "a crash loop (then the service stays up in the 'failed' state).",
        checks=(at_least(1),),
    )
    restart_window_s: float = option(
        60.0, "Window for --max-restarts, in seconds.", checks=(positive,)
    )
    shutdown_timeout: float = option(  # seconds
        10.0,
        "Seconds that requests in flight may run on after SIGTERM/SIGINT (new ones get "
        "503); those still running then end with a 'server_shutting_down' error.",
        checks=(at_least(0, "seconds"),),
    )
    log_level: str = option(
        "info",
        "debug, info, warning or error.",
        checks=(one_of("debug", "info", "warning", "error", ignore_case=True),),
    )
    log_file: str | None = option(
        None,
        "Write the log to this file instead of stderr, rotated at 10 MiB with 5 older "
        "files kept (headroom.log.1 ... .5); 'auto': headroom.log in the user log folder "
        "(~/.local/state/headroom/log on Linux, ~/Library/Logs/headroom on macOS, "
        "%LOCALAPPDATA%\\headroom\\Logs on Windows; HEADROOM_LOG_DIR moves it). Unset: "
        "stderr (under systemd, the journal). The macOS and Windows services set 'auto'.",
    )
    # Not a user option: "module:callable" building the engine in the worker (tests
    # use a fake one). Read from HEADROOM_ENGINE_FACTORY only.
    engine_factory: str = ENGINE_FACTORY
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def keep_alive_s(self) -> float | None:
        """``--keep-alive`` in seconds, None for never (unset, or negative as Ollama's -1)."""
        if self.keep_alive is None:
            return None
        seconds = parse_duration(self.keep_alive)
        return None if seconds < 0 else seconds

    def engine_config(self) -> EngineConfig:
        """The engine's part of these settings (the fields of the same names)."""
        return pick(self, EngineConfig)

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            engine=self.engine_config(),
            parent_pid=os.getpid(),
            heartbeat_interval_s=self.heartbeat_interval_s,
            engine_factory=self.engine_factory,
        )


# Every option of `headroom serve`: the engine's, then the service's.
OPTIONS: tuple[Option, ...] = options_of(ServeSettings)
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}
