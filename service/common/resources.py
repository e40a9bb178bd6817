"""Files the service ships besides its code: the built dashboard (``/ui``) and the
service definitions' templates (``headroom service install``).

They live outside the Python packages in the source tree (``ui-bridge/dashboard``,
``installers/templates``); a wheel carries copies in ``service/_data/<name>``, made by
``setup.py``'s build step from :data:`SOURCES`. :func:`data_dir` finds them either way:
the packaged copy when there is one, else the source tree (a checkout or an editable
install). This module imports nothing but the standard library: ``setup.py`` reads
:data:`SOURCES` from it before anything is installed.
"""

from __future__ import annotations

from pathlib import Path

# name -> (folder in the source tree, file patterns copied from it, not recursive)
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dashboard": ("ui-bridge/dashboard", ("*.html", "*.js", "*.css", "*.map", "*.svg")),
    "templates": ("installers/templates", ("*",)),
}
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "_data"  # service/_data
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def data_dir(name: str) -> Path:
    """The folder holding ``name``'s files (a key of :data:`SOURCES`): the wheel's copy,
    else the source tree's. The folder may be missing (a broken install); callers say so.

    Raises:
        KeyError: an unknown name.
    """
    source, _ = SOURCES[name]
    packaged = PACKAGED_DIR / name
    if packaged.is_dir():
        return packaged
    return SOURCE_ROOT / source
