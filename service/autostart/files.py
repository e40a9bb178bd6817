"""The files of a login service's definition: written only when their text changed,
put back as they were when an install fails, and the folders an install made removed
while they are empty."""

from __future__ import annotations

import os
from pathlib import Path


def first_missing(folder: Path) -> Path | None:
    """The highest ancestor of ``folder`` (itself included) that does not exist."""
    missing = None
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def write_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` atomically unless the file already holds it; True when written."""
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def remove_empty_dirs(folder: Path, stop: Path) -> None:
    """Remove ``folder`` and its parents while they are empty, never ``stop`` or above."""
    stop = stop.resolve()
    folder = folder.resolve()
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty, or gone
            if folder.exists():
                return
        folder = folder.parent


def restore(path: Path, before: bytes | None, made: Path | None) -> None:
    """Put ``path`` back as it was before an install: its old bytes (``before``), or
    gone when it did not exist, with the folders the install made (``made``, the
    highest, from :func:`first_missing`) removed while empty."""
    if before is None:
        path.unlink(missing_ok=True)
    elif path.exists() and path.read_bytes() != before:
        write_if_changed(path, before)
    if made is not None:
        remove_empty_dirs(path.parent, made.parent)

