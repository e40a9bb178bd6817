"""headroom's cache folder, where converted models, the store, cached config facts and
the built C kernels live. Torch-free: every floor may ask for it."""

from __future__ import annotations

from pathlib import Path

from engine.common.environment import CACHE_DIR

CACHE_ENV = CACHE_DIR.name


def cache_root() -> Path:
    """headroom's cache folder: ``$HEADROOM_CACHE_DIR`` if set, else the platform's user
    cache dir (``~/.cache/headroom`` on Linux)."""
    env = CACHE_DIR.get()
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("headroom"))
