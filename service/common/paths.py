"""The user folders headroom reads and writes, from platformdirs, each with a
``HEADROOM_*`` variable that moves it (tests, several installs side by side).

- config: ``HEADROOM_CONFIG_DIR`` or ``user_config_dir("headroom")`` (``~/.config/headroom``
  on Linux): ``config.toml`` and the local token.
- logs: ``HEADROOM_LOG_DIR`` or ``user_log_dir("headroom")`` (``~/.local/state/headroom/log``
  on Linux, ``~/Library/Logs/headroom`` on macOS, ``%LOCALAPPDATA%\\headroom\\Logs`` on
  Windows): ``headroom.log`` when serving with ``--log-file auto``.
- runtime: ``HEADROOM_RUNTIME_DIR`` or ``user_runtime_dir("headroom")`` (``$XDG_RUNTIME_DIR``
  on Linux; without that variable, ``/run/user/<uid>`` where systemd made it, else
  platformdirs' private folder under the temporary dir, chosen without its warning).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import platformdirs

from engine.common import environment

APP_NAME = "headroom"
CONFIG_DIR_ENV = environment.CONFIG_DIR.name
LOG_DIR_ENV = environment.LOG_DIR.name
RUNTIME_DIR_ENV = environment.RUNTIME_DIR.name


class RuntimeDirError(OSError):
    """``HEADROOM_RUNTIME_DIR`` names a folder that cannot be made or used; the
    message names the variable and the fix."""


def _override(setting: environment.EnvSetting, env: Mapping[str, str] | None = None) -> Path | None:
    value = setting.get(env)
    return Path(value).expanduser() if value else None


def config_dir(env: Mapping[str, str] | None = None) -> Path:
    """The user's headroom config folder (``HEADROOM_CONFIG_DIR`` in ``env``, the
    process's environment when None, wins)."""
    return _override(environment.CONFIG_DIR, env) or Path(
        platformdirs.user_config_dir(APP_NAME, appauthor=False)
    )


def log_dir() -> Path:
    """The user's headroom log folder (``HEADROOM_LOG_DIR`` wins); not created here."""
    return _override(environment.LOG_DIR) or Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))


def runtime_dir() -> Path:
    """The user's headroom runtime folder (``HEADROOM_RUNTIME_DIR`` wins); not created
    here.

    On Linux without ``XDG_RUNTIME_DIR`` (a service started outside a login session, a
    container, ``su``), platformdirs falls back to a private folder under the temporary
    dir and warns on every call; that fallback is right for us, so the warning is not
    shown, and systemd's ``/run/user/<uid>`` is taken first when it exists.
    """
    override = _override(environment.RUNTIME_DIR)
    if override is not None:
        return override
    if sys.platform.startswith("linux") and not os.environ.get("XDG_RUNTIME_DIR"):
        systemd_dir = Path(f"/run/user/{os.getuid()}")
        if systemd_dir.is_dir() and os.access(systemd_dir, os.W_OK):
            return systemd_dir / APP_NAME
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            return Path(platformdirs.user_runtime_dir(APP_NAME))
    return Path(platformdirs.user_runtime_dir(APP_NAME))
