"""Build hook: the wheel carries the built dashboard and the service templates.

Everything else about the package is declared in pyproject.toml. The files live outside
the Python packages (``ui-bridge/dashboard``, ``installers/templates``); this build step
copies them into ``service/_data/`` of the wheel, where ``service.common.resources.data_dir``
finds them. An editable install reads them from the source tree instead.

The dashboard's script (``ui-bridge/dashboard/app.js``) is not committed: where it is
missing, the wheel's and the sdist's build make it with npm
(``service.common.resources.build_dashboard``) and fail, naming the fix, without Node.js; an
editable install builds it when npm is there and otherwise leaves it to ``make
dashboard`` (the service says so at ``/ui`` and in ``headroom doctor``).
"""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
RESOURCES = runpy.run_path(str(HERE / "service" / "common" / "resources.py"))
SOURCES = RESOURCES["SOURCES"]
REQUIRED = ("dashboard/index.html", "dashboard/app.js")


def ensure_dashboard(*, required: bool) -> None:
    """Build the dashboard's script where it is missing; without npm, fail when
    ``required`` (naming the fix), else say so and go on."""
    if (HERE / "ui-bridge" / "dashboard" / RESOURCES["DASHBOARD_BUNDLE"]).is_file():
        return
    if not required and shutil.which("npm") is None:
        print(
            f"headroom: the dashboard is not built (npm is missing): run {RESOURCES['DASHBOARD_BUILD']}"
        )
        return
    try:
        RESOURCES["build_dashboard"](HERE)
    except RuntimeError as exc:
        raise SystemExit(f"cannot build headroom: {exc}") from None


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        ensure_dashboard(required=not self.editable_mode)
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "service" / "_data"
        shutil.rmtree(target, ignore_errors=True)
        for name, (folder, patterns) in SOURCES.items():
            for pattern in patterns:
                for path in sorted((HERE / folder).glob(pattern)):
                    if path.is_file():
                        (target / name).mkdir(parents=True, exist_ok=True)
                        shutil.copy2(path, target / name / path.name)
        missing = [r for r in REQUIRED if not (target / r).is_file()]
        if missing:
            raise SystemExit(f"cannot build headroom: missing {', '.join(missing)} in the source")


class SdistWithDashboard(sdist):
    """The sdist carries the built dashboard (MANIFEST.in), not the TypeScript it comes
    from: it is built first where it is missing."""

    def run(self) -> None:
        ensure_dashboard(required=True)
        super().run()


setup(cmdclass={"build_py": BuildPyWithData, "sdist": SdistWithDashboard})
