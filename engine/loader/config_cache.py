"""The :class:`ModelConfig` a model folder's config files gave, cached in headroom's
cache folder, so a worker start reads it without importing transformers.

Reading ``config.json`` through ``transformers.AutoConfig`` imports some 980 modules and
holds about 77 MiB of the worker's resident memory for its whole life (measured on the
default model with transformers 5), for facts that depend only on the config files'
bytes. The record is keyed by those bytes (``config.json``, ``generation_config.json``),
the source of the code that derives the facts (``engine/loader/hf_config.py``,
``engine/common/config.py``) and the installed transformers version, so any change to one of
them misses and derives anew; a record that cannot be read is a miss, and a cache that
cannot be written is skipped (the facts are derived every time then).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path

import msgspec

from engine.common.config import ModelConfig

log = logging.getLogger("headroom.engine")

# The code that derives the facts: a change to it makes every record stale.
_SOURCES = (Path(__file__).with_name("hf_config.py"), Path(__file__).parents[1] / "common" / "config.py",
            Path(__file__).parents[1] / "models" / "registry.py")


def _key(model_dir: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        h.update(path.read_bytes() if path.is_file() else b"-")
        h.update(b"\0")
    for source in _SOURCES:
        h.update(source.read_bytes())
    try:
        h.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:
        h.update(b"no transformers")
    return h.hexdigest()[:24]


def _record(model_dir: Path) -> Path:
    from engine.common.cache_dir import cache_root

    return cache_root() / "model-facts" / f"{_key(model_dir)}.json"


def cached_config(model_dir: Path) -> ModelConfig | None:
    """The cached facts of ``model_dir``'s config files, or None (none yet, or unreadable)."""
    try:
        return msgspec.json.decode(_record(model_dir).read_bytes(), type=ModelConfig)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def store_config(model_dir: Path, config: ModelConfig) -> None:
    """Record ``config`` for ``model_dir``'s config files (a temporary file renamed into
    place; nothing, with a debug line, where the cache cannot be written)."""
    try:
        record = _record(model_dir)
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".facts-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(config))
            os.replace(tmp, record)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.debug("model facts not cached: %s", exc)
