"""The wheel: built from a copy of the source in a temporary folder (``pip wheel
--no-deps``), installed into a fresh virtual environment that reuses this
environment's installed dependencies (a ``.pth`` file naming its site-packages), it
carries the dashboard and the service templates, and its ``headroom serve`` serves
``/ui/`` from them, with no source tree in sight (no PYTHONPATH, another working
folder). The copy has no ``app.js`` (it is not committed): the build makes it, the same
as this checkout's; without Node.js the build fails and names the fix.

Slow (a wheel build and a venv, about half a minute on 2 busy cores).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from service_harness import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def copy_source(dest: Path) -> Path:
    """The files git tracks (or would: untracked, not ignored) of this checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def buildable_source(dest: Path) -> Path:
    """:func:`copy_source` with this checkout's ``ui-bridge/node_modules`` linked in where
    it has them (else a build of the copy runs ``npm ci``, fetching them again): a build
    of the copy still bundles the dashboard, whose script is not among the copied files."""
    source = copy_source(dest)
    assert not (source / "ui-bridge" / "dashboard" / "app.js").exists()
    if (ROOT / "ui-bridge" / "node_modules").is_dir():
        (source / "ui-bridge" / "node_modules").symlink_to(ROOT / "ui-bridge" / "node_modules")
    return source


def build_wheel(tmp: Path) -> Path:
    source = buildable_source(tmp / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = (tmp / "dist").glob("headroom-*.whl")
    return wheel


def fresh_venv(path: Path) -> Path:
    """A venv without pip whose interpreter also sees this environment's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "reuse-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


@pytest.mark.skipif(sys.platform == "win32", reason="the venv layout is POSIX's")
@pytest.mark.usefixtures("built_dashboard")
def test_the_wheel_carries_the_dashboard_and_serves_ui(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "dashboard/index.html",
        "dashboard/app.js",
        "templates/headroom.service",
        "templates/headroom.plist",
        "templates/headroom-task.xml",
    ):
        assert f"service/_data/{name}" in names
    assert not any(n.startswith("service/_data/dashboard/src") for n in names)

    python = fresh_venv(tmp_path / "venv")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    env = clean_env()
    where = subprocess.run(
        [str(python), "-c", "from service.common.resources import data_dir; print(data_dir('dashboard'))"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "venv"), where
    headroom = tmp_path / "venv" / "bin" / "headroom"
    version = subprocess.run(
        [str(headroom), "--version"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    assert version.stdout.strip() == "headroom 0.1.0"

    config = tmp_path / "config.toml"
    config.write_text("")
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    serve = subprocess.Popen(
        [str(headroom), "serve", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=clean_env(
            HEADROOM_CONFIG=str(config),
            HEADROOM_CONFIG_DIR=str(tmp_path / "cfg"),
            HEADROOM_RUNTIME_DIR=str(tmp_path / "run"),
        ),
    )
    try:

        def ui():
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ui/", timeout=5)
            except httpx.HTTPError:
                return None

        response = wait_for(ui, 120, "/ui/ to answer")  # served while the engine loads
        assert response.status_code == 200, response.text
        assert response.content == (ROOT / "ui-bridge" / "dashboard" / "index.html").read_bytes()
        script = httpx.get(f"http://127.0.0.1:{port}/ui/app.js", timeout=5)
        assert script.status_code == 200
        assert script.content == (ROOT / "ui-bridge" / "dashboard" / "app.js").read_bytes()
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        log.close()


@pytest.mark.skipif(sys.platform == "win32", reason="a PATH without npm is spelled for POSIX")
def test_the_build_without_node_names_the_fix(tmp_path):
    """setup.py's build step, in a source tree without app.js and with no npm on the
    PATH, stops with what to install and what to run."""
    for name in (
        "pyproject.toml",
        "setup.py",
        "README.md",
        "MANIFEST.in",
        "service/__init__.py",
        "service/common/__init__.py",
        "service/common/resources.py",
        "ui-bridge/dashboard/index.html",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    result = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=clean_env(PATH=str(tmp_path / "no-bin")),
        timeout=120,
    )
    assert result.returncode != 0
    assert "npm is missing" in result.stderr and "`make dashboard`" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "service" / "_data").exists()
