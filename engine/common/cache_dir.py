"""headroom's cache folder, where converted models, the store, cached config facts and
the built C kernels live. Torch-free: every floor may ask for it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HEADROOM_CACHE_DIR"


def cache_root() -> Path:
    """headroom's cache folder: ``$HEADROOM_CACHE_DIR`` if set, else the platform's user
    cache dir (``~/.cache/headroom`` on Linux)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("headroom"))
