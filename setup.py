"""Build hook: the wheel carries the built dashboard and the service templates.

Everything else about the package is declared in pyproject.toml. The files live outside
the Python packages (``ui-bridge/dashboard``, ``installers/templates``); this build step
copies them into ``service/_data/`` of the wheel, where ``service.common.resources.data_dir``
finds them. An editable install reads them from the source tree instead.
"""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SOURCES = runpy.run_path(str(HERE / "service" / "common" / "resources.py"))["SOURCES"]
REQUIRED = ("dashboard/index.html", "dashboard/app.js")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
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


setup(cmdclass={"build_py": BuildPyWithData})
