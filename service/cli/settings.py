"""``headroom serve`` settings: defaults < config file < environment < flags.

Every setting is declared once in :data:`OPTIONS`; the CLI builds its flags (and its
``--help``) from that table, the environment variable is ``HEADROOM_`` + the name in
capitals, and the config file key is the name itself. The config file is TOML at
``platformdirs.user_config_dir("headroom")/config.toml`` (``--config`` or
``HEADROOM_CONFIG`` point elsewhere); its keys sit at the top level or under a
``[serve]`` table. List settings take a list in TOML and comma-separated text in the
environment. Sizes (``--reserve``, ``--kv-cache``...) are text everywhere: ``6GiB``,
``5.5GiB``, ``512MiB``, ``6GB`` (decimal) or a number of bytes (:func:`parse_size`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from engine.config import EngineConfig
from engine.ipc import WorkerConfig
from engine.units import (
    parse_size as parse_size,  # one table of units for the engine and the service
)

DEFAULT_PORT = 8427
ENV_PREFIX = "HEADROOM_"


class SettingsError(Exception):
    """A setting has a value that cannot be used; the message names its source."""


@dataclass(frozen=True)
class Option:
    """One setting: its name (also the TOML key), type, default and help text."""

    name: str
    type: type
    default: Any
    help: str
    multiple: bool = False
    # "size": a memory size (text, see parse_size) resolved to bytes; "size_or_auto":
    # the same or "auto" (resolved to None).
    kind: str | None = None

    @property
    def metavar(self) -> str | None:
        return {"size": "SIZE", "size_or_auto": "auto|SIZE"}.get(self.kind or "")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option(
        "host",
        str,
        "127.0.0.1",
        "Address to bind. Keep the loopback default unless you "
        "mean to serve other machines (then also set --allowed-host).",
    ),
    Option("port", int, DEFAULT_PORT, f"TCP port to listen on (default {DEFAULT_PORT})."),
    Option(
        "model",
        str,
        None,
        "Hugging Face model folder or .gguf file; unset serves the "
        "embedded default model (SmolLM2-135M-Instruct).",
    ),
    Option("device", str, "auto", "auto (CUDA when present), cpu, or cuda[:N]."),
    Option("dtype", str, "auto", "auto, float32, bfloat16 or float16."),
    Option(
        "max_model_len",
        int,
        None,
        "Cap on tokens per request (prompt + completion); "
        "unset: the model's context, or what the KV cache holds.",
    ),
    Option("max_running_requests", int, 64, "Most requests decoded together."),
    Option(
        "max_prefill_tokens",
        int,
        2048,
        "Most prompt tokens per prefill step (the chunk of chunked prefill).",
    ),
    Option("page_size", int, 16, "KV cache page size, in tokens."),
    Option(
        "num_pages",
        int,
        None,
        "Fix the KV cache size in pages, skipping the memory plan (unset: planned).",
    ),
    Option(
        "kv_cache",
        str,
        None,
        "Fix the KV cache size (e.g. 2GiB), skipping the memory plan (unset: planned).",
        kind="size",
    ),
    Option(
        "reserve",
        str,
        "auto",
        "GPU memory left to the desktop and other apps: auto (512 MiB + 5% of the card "
        "when it drives a display, else 0) or a size such as 1GiB.",
        kind="size_or_auto",
    ),
    Option(
        "device_limit",
        str,
        None,
        "Serve as on a GPU of this size (e.g. 16GiB; unset: the whole card): the plan, the VRAM watcher and live replans all read a card of this size, other processes' memory counting against it.",
        kind="size",
    ),
    Option(
        "min_context",
        int,
        None,
        "Smallest context, in tokens, one request must get for the memory plan to fit "
        "(unset: the model's context, capped by --max-model-len).",
    ),
    Option(
        "device_total",
        str,
        None,
        "Simulate a GPU of this size instead of reading the real one (e.g. 6GiB), to try "
        "the memory plan on a machine without one; the engine still runs on --device.",
        kind="size",
    ),
    Option(
        "device_free",
        str,
        None,
        "Free memory of the simulated GPU (needs --device-total; unset: all of it).",
        kind="size",
    ),
    Option(
        "device_display",
        bool,
        True,
        "Whether the simulated GPU (--device-total) drives a display, which the "
        "automatic --reserve keeps memory for.",
    ),
    Option(
        "vram_source",
        str,
        "nvml",
        "Where GPU memory is read while serving: nvml (the real card; without an NVIDIA "
        "GPU or driver: CPU mode, no replans) or simulated (a card of --device-total "
        "whose other processes follow --vram-timeline).",
    ),
    Option(
        "vram_timeline",
        str,
        None,
        "JSON file scripting other processes' memory on the simulated card "
        '(--vram-source simulated): {"steps": [[seconds, size], ...]} with sizes such as '
        '"1.2GiB", bytes or "40%" of the card, seconds counted from when the engine is '
        'first ready ("start": "service" counts from the service\'s start); optional '
        '"total" (the card) and "display" (bool).',
    ),
    Option(
        "vram_hz",
        float,
        4.0,
        "GPU memory samples per second; each goes to the event socket (coalesced) and to "
        "the replan controller.",
    ),
    Option(
        "replan_low",
        str,
        None,
        "Low water mark of headroom (free - reserve): below it the engine gives memory "
        "back (prefill chunk, prefix cache, KV pool). Unset: a quarter of the plan's "
        "safety margin (128 MiB + 1% of the card).",
        kind="size",
    ),
    Option(
        "replan_high",
        str,
        None,
        "High water mark of headroom: above it for --replan-hold seconds, the KV pool grows "
        "back toward the plan. Unset: the low mark + 256 MiB + 2% of the card.",
        kind="size",
    ),
    Option(
        "replan_hold",
        float,
        10.0,
        "Seconds the headroom must stay above --replan-high before the pool grows back.",
    ),
    Option("prefix_cache", bool, True, "Share KV pages of common prompt prefixes."),
    Option(
        "served_model_name",
        str,
        (),
        "Another name the model answers to in the API (repeatable).",
        multiple=True,
    ),
    Option("api_key", str, None, "Require 'Authorization: Bearer KEY' on /v1 (unset: no key)."),
    Option(
        "cors_origin",
        str,
        (),
        "A browser origin to allow besides tauri://localhost, "
        "http(s)://tauri.localhost and http://localhost:1420 (repeatable; * allows "
        "all).",
        multiple=True,
    ),
    Option(
        "allowed_host",
        str,
        (),
        "A Host header name to accept besides loopback names (repeatable).",
        multiple=True,
    ),
    Option(
        "max_body_size",
        str,
        "32MiB",
        "Largest request body; a larger one is answered 413 before it is read "
        "(its Content-Length) or as soon as it passes the limit (chunked).",
        kind="size",
    ),
    Option(
        "max_header_size",
        str,
        "64KiB",
        "Largest request line plus headers; a larger request is refused with 400 "
        "before it reaches the app.",
        kind="size",
    ),
    Option(
        "max_queued_requests",
        int,
        256,
        "Most API requests waiting for the engine (admitted, no token out yet); past it "
        "503 with Retry-After at once (0: no limit).",
    ),
    Option(
        "request_timeout",
        float,
        0.0,
        "Seconds a completion request may take from arrival to its last token; past it "
        "the engine drops it and the client gets a 504 request_timeout error (0: none).",
    ),
    Option("heartbeat_interval_s", float, 0.5, "Seconds between the worker's heartbeats."),
    Option(
        "stall_timeout_s",
        float,
        30.0,
        "Seconds without a heartbeat after which a worker counts as hung and is restarted.",
    ),
    Option(
        "start_timeout_s",
        float,
        900.0,
        "Seconds a worker may take to load before it is killed and restarted.",
    ),
    Option(
        "max_restarts",
        int,
        5,
        "Worker exits within --restart-window-s that count as "
        "a crash loop (then the service stays up in the 'failed' state).",
    ),
    Option("restart_window_s", float, 60.0, "Window for --max-restarts, in seconds."),
    Option(
        "shutdown_timeout",
        float,
        10.0,
        "Seconds that requests in flight may run on after SIGTERM/SIGINT (new ones get "
        "503); those still running then end with a 'server_shutting_down' error.",
    ),
    Option("log_level", str, "info", "debug, info, warning or error."),
)
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class ServeSettings:
    """Resolved settings of one ``headroom serve``; see :data:`OPTIONS` for each."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    page_size: int = 16
    num_pages: int | None = None
    kv_cache: int | None = None  # bytes
    reserve: int | None = None  # bytes; None: auto
    device_limit: int | None = None  # bytes
    min_context: int | None = None
    device_total: int | None = None  # bytes
    device_free: int | None = None  # bytes
    device_display: bool = True
    vram_source: str = "nvml"
    vram_timeline: str | None = None
    vram_hz: float = 4.0
    replan_low: int | None = None  # bytes
    replan_high: int | None = None  # bytes
    replan_hold: float = 10.0
    prefix_cache: bool = True
    served_model_name: tuple[str, ...] = ()
    api_key: str | None = None
    cors_origin: tuple[str, ...] = ()
    allowed_host: tuple[str, ...] = ()
    max_body_size: int = 32 << 20  # bytes
    max_header_size: int = 64 << 10  # bytes
    max_queued_requests: int = 256
    request_timeout: float = 0.0  # seconds; 0: none
    heartbeat_interval_s: float = 0.5
    stall_timeout_s: float = 30.0
    start_timeout_s: float = 900.0
    max_restarts: int = 5
    restart_window_s: float = 60.0
    shutdown_timeout: float = 10.0  # seconds
    log_level: str = "info"
    # Not a user option: "module:callable" building the engine in the worker (tests
    # use a fake one). Read from HEADROOM_ENGINE_FACTORY only.
    engine_factory: str = "engine.engine:Engine"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens,
            max_model_len=self.max_model_len,
            num_pages=self.num_pages,
            kv_cache_bytes=self.kv_cache,
            enable_prefix_cache=self.prefix_cache,
            reserve_bytes=self.reserve,
            device_limit_bytes=self.device_limit,
            min_context_tokens=self.min_context,
            simulate_device_total_bytes=self.device_total,
            simulate_device_free_bytes=self.device_free,
            simulate_display_attached=self.device_display,
        )

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            engine=self.engine_config(),
            parent_pid=os.getpid(),
            heartbeat_interval_s=self.heartbeat_interval_s,
            engine_factory=self.engine_factory,
        )


def default_config_path() -> Path:
    """``<user config dir>/headroom/config.toml`` (platformdirs)."""
    from platformdirs import user_config_dir

    return Path(user_config_dir("headroom")) / "config.toml"


def _convert(option: Option, value: Any, source: str) -> Any:
    """Coerce a value from the file (typed) or the environment (text)."""
    if option.multiple:
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",")]
        elif isinstance(value, list):
            items = value
        else:
            raise SettingsError(f"{source}: {option.name} must be a list of strings")
        return tuple(_convert_one(option, v, source) for v in items if v != "")
    return _convert_one(option, value, source)


def _convert_size(option: Option, value: Any, source: str) -> int | None:
    """A size option's value (text or bytes) as bytes; ``"auto"`` is None where allowed.

    Raises:
        SettingsError: not a size, naming the source (the flag, the variable or the file).
    """
    if value is None:
        return None
    if option.kind == "size_or_auto" and isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        text = str(exc)
        if option.kind == "size_or_auto":
            text = text.replace("; write ", "; write auto or ")
        where = source if source == option.flag else f"{source}: {option.name}"
        raise SettingsError(f"{where}: {text}") from None


def _convert_one(option: Option, value: Any, source: str) -> Any:
    if option.kind is not None:
        return _convert_size(option, value, source)
    kind = option.type
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int and isinstance(value, (bool, float)):
            raise ValueError(value)
        if kind is str and not isinstance(value, str):
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise SettingsError(
            f"{source}: {option.name} = {value!r} is not a valid {kind.__name__}"
        ) from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings in a TOML file (top level merged with ``[serve]``).

    Raises:
        SettingsError: unreadable or invalid TOML, or an unknown key.
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    serve = data.get("serve", {})
    # Other commands may keep their own tables; scalars at the top level are ours.
    merged = {k: v for k, v in data.items() if not isinstance(v, dict)}
    if isinstance(serve, dict):
        merged.update(serve)
    for key in merged:
        if key.replace("-", "_") not in OPTIONS_BY_NAME:
            raise SettingsError(
                f"config file {path}: unknown setting {key!r}; known: "
                + ", ".join(o.name for o in OPTIONS)
            )
    return {k.replace("-", "_"): v for k, v in merged.items()}


def resolve(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> ServeSettings:
    """Merge the sources, later winning: defaults, config file, environment, flags.

    Args:
        flags: option name -> value from the command line; None (or an empty tuple
            for repeatable options) means "not given".
        env: the environment (``os.environ`` when None).
        config_path: the TOML file; None means ``HEADROOM_CONFIG`` or the default
            path. A missing default file is fine; a missing explicit one is an error.

    Raises:
        SettingsError: a bad value, naming where it came from.
    """
    env = os.environ if env is None else env
    explicit = config_path is not None or bool(env.get(ENV_PREFIX + "CONFIG"))
    path = config_path or Path(env.get(ENV_PREFIX + "CONFIG") or default_config_path())
    file_values: dict[str, Any] = {}
    if path.exists():
        file_values = read_config_file(path)
    elif explicit:
        raise SettingsError(f"config file {path} does not exist")

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        value, source = option.default, "default"
        if option.name in file_values:
            value = _convert(option, file_values[option.name], f"config file {path}")
            source = str(path)
        if option.env in env and env[option.env] != "":
            value = _convert(option, env[option.env], f"environment {option.env}")
            source = option.env
        flag_value = flags.get(option.name)
        if flag_value is not None and flag_value != ():
            value = tuple(flag_value) if option.multiple else flag_value
            source = option.flag
            if option.kind is not None:
                value = _convert_size(option, value, option.flag)
        elif option.kind is not None and source == "default":
            value = _convert_size(option, value, "default")
        values[option.name] = value
        sources[option.name] = source
    factory = env.get(ENV_PREFIX + "ENGINE_FACTORY")
    if factory:
        values["engine_factory"] = factory
    settings = ServeSettings(**values, sources=sources)
    _validate(settings)
    return settings


def _validate(s: ServeSettings) -> None:
    def fail(name: str, why: str) -> None:
        raise SettingsError(f"{OPTIONS_BY_NAME[name].flag} ({s.sources[name]}): {why}")

    if not 0 <= s.port <= 65535:
        fail("port", f"{s.port} is not a TCP port (0-65535)")
    for name in ("max_running_requests", "max_prefill_tokens", "page_size", "max_restarts"):
        if getattr(s, name) < 1:
            fail(name, "must be at least 1")
    for name in ("heartbeat_interval_s", "stall_timeout_s", "start_timeout_s", "restart_window_s"):
        if getattr(s, name) <= 0:
            fail(name, "must be positive")
    if s.min_context is not None and s.min_context < 1:
        fail("min_context", "must be at least 1")
    if s.num_pages is not None and s.num_pages < 2:
        fail("num_pages", "must be at least 2 (one page is the null page)")
    if s.max_model_len is not None and s.max_model_len < 2:
        fail("max_model_len", "must be at least 2")
    for name in ("kv_cache", "device_limit", "device_total"):
        if getattr(s, name) == 0:
            fail(name, "must be more than 0 bytes")
    if s.device_free is not None:
        if s.device_total is None:
            fail("device_free", "needs --device-total (the size of the simulated GPU)")
        elif s.device_free > s.device_total:
            fail("device_free", "must not exceed --device-total")
    if s.vram_source not in ("nvml", "simulated"):
        fail("vram_source", f"{s.vram_source!r} is not one of nvml, simulated")
    if s.vram_source == "simulated" and s.device_total is None and s.vram_timeline is None:
        fail("vram_source", "simulated needs --device-total (or a --vram-timeline with a total)")
    if s.vram_timeline is not None and s.vram_source != "simulated":
        fail("vram_timeline", "needs --vram-source simulated")
    if s.vram_hz <= 0:
        fail("vram_hz", "must be positive")
    if s.replan_hold < 0:
        fail("replan_hold", "must be at least 0")
    if s.replan_low is not None and s.replan_high is not None and s.replan_low >= s.replan_high:
        fail("replan_high", "must be above --replan-low")
    if s.shutdown_timeout < 0:
        fail("shutdown_timeout", "must be at least 0 (seconds)")
    if s.stall_timeout_s <= s.heartbeat_interval_s:
        fail("stall_timeout_s", "must be longer than --heartbeat-interval-s")
    if s.max_body_size < 1024:
        fail("max_body_size", "must be at least 1KiB")
    if s.max_header_size < 4096:
        fail("max_header_size", "must be at least 4KiB")
    if s.max_queued_requests < 0:
        fail("max_queued_requests", "must be at least 0 (0: no limit)")
    if s.request_timeout < 0:
        fail("request_timeout", "must be at least 0 (0: none)")
    if s.log_level.lower() not in ("debug", "info", "warning", "error"):
        fail("log_level", f"{s.log_level!r} is not one of debug, info, warning, error")
