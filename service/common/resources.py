"""Files the service ships besides its code: the built dashboard (``/ui``) and the
service definitions' templates (``headroom service install``).

They live outside the Python packages in the source tree (``ui-bridge/dashboard``,
``installers/templates``); a wheel carries copies in ``service/_data/<name>``, made by
``setup.py``'s build step from :data:`SOURCES`. :func:`data_dir` finds them either way:
the packaged copy when there is one, else the source tree (a checkout or an editable
install). This module imports nothing but the standard library: ``setup.py`` reads
:data:`SOURCES` and :func:`build_dashboard` from it before anything is installed.

The dashboard's script (:data:`DASHBOARD_BUNDLE`) is not committed: esbuild bundles it
from ``ui-bridge``'s TypeScript. ``make dashboard``, ``setup.py``'s build step and the
tests build it (:func:`build_dashboard`); the service, finding it missing, names the fix
(:func:`dashboard_problem`) and serves the API without it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# name -> (folder in the source tree, file patterns copied from it, not recursive)
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dashboard": ("ui-bridge/dashboard", ("*.html", "*.js", "*.css", "*.map", "*.svg")),
    "templates": ("installers/templates", ("*",)),
}
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "_data"
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# The dashboard's built script, in the dashboard's folder, and how to build it.
DASHBOARD_BUNDLE = "app.js"
DASHBOARD_BUILD = "`make dashboard` (or `cd ui-bridge && npm ci && npm run build:dashboard`)"


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


def dashboard_missing(folder: Path | None = None) -> list[str]:
    """The dashboard's files missing in ``folder`` (default: ``data_dir("dashboard")``):
    ``index.html`` and the built :data:`DASHBOARD_BUNDLE`; empty when it can be served."""
    folder = folder if folder is not None else data_dir("dashboard")
    return [n for n in ("index.html", DASHBOARD_BUNDLE) if not (folder / n).is_file()]


def dashboard_problem(folder: Path | None = None) -> str | None:
    """Why the dashboard cannot be served from ``folder`` (default: ``data_dir("dashboard")``),
    a sentence naming what is missing and the fix; None when nothing is missing."""
    folder = folder if folder is not None else data_dir("dashboard")
    missing = dashboard_missing(folder)
    if not missing:
        return None
    return (
        f"the dashboard is not built ({' and '.join(missing)} missing in {folder}): "
        f"build it with {DASHBOARD_BUILD} in headroom's source tree"
    )


def build_dashboard(root: Path = SOURCE_ROOT) -> Path:
    """Build the dashboard's script in the source tree at ``root``: ``npm ci`` in
    ``ui-bridge`` first when it has no ``node_modules``, then ``npm run build:dashboard``
    (their output is shown as they run).

    Returns:
        The path of the bundle, ``<root>/ui-bridge/dashboard/app.js``.

    Raises:
        RuntimeError: npm (Node.js) is missing, or a step failed; the message names the fix.
    """
    ui = root / "ui-bridge"
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"the dashboard ({ui / 'dashboard' / DASHBOARD_BUNDLE}) is built with Node.js, and "
            "npm is missing: install Node.js 20 or newer with npm (Debian: apt-get install "
            f"nodejs npm), then run {DASHBOARD_BUILD}"
        )
    steps = [] if (ui / "node_modules").is_dir() else [["ci", "--no-audit", "--no-fund"]]
    for step in [*steps, ["run", "build:dashboard"]]:
        result = subprocess.run([npm, *step], cwd=ui, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"`npm {' '.join(step)}` in {ui} failed (exit {result.returncode}); "
                f"its output above says why, then run {DASHBOARD_BUILD}"
            )
    return ui / "dashboard" / DASHBOARD_BUNDLE
