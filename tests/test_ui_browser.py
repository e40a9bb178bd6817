"""The dashboard at ``/ui`` in headless Chromium, against a real ``headroom serve`` (the
default model on the CPU, planned for a simulated 4 GiB card whose other processes
breathe): ``ui-bridge/scripts/browser-test.mjs`` (playwright-core driving Debian's
chromium) sees the chart move and the plan ledger, kills the worker and sees the exit,
``restarting`` and ``ready`` again; then a new user's first minute: the service's address
leads to the page, which asks for the token with its form, the Restart button's exit says
who asked, and the chat panel answers. Its screenshots stay in the test's tmp dir; their
paths are printed (``pytest -s`` shows them).

Skipped without Node/npm or Chromium (``make test`` installs both: see the Makefile).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from service_harness import simulated_vram_args

pytestmark = pytest.mark.slow

UI_BRIDGE = Path(__file__).resolve().parent.parent / "ui-bridge"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def npm_ci() -> None:
    """``npm ci`` in ui-bridge, unless node_modules already matches the lock file."""
    installed = UI_BRIDGE / "node_modules" / ".package-lock.json"
    lock = UI_BRIDGE / "package-lock.json"
    if (
        installed.exists()
        and installed.stat().st_mtime >= lock.stat().st_mtime
        and (UI_BRIDGE / "node_modules" / "playwright-core").is_dir()
    ):
        return
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=UI_BRIDGE, check=True, timeout=900)


@pytest.mark.usefixtures("built_dashboard")
@pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="no Node.js/npm"
)
@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"
)
def test_dashboard_in_headless_chromium(start_server, tmp_path):
    npm_ci()
    # A browser that breathes (100-320 MiB) for ten minutes: the chart has something to draw.
    steps = [[t / 2, f"{210 + 110 * math.sin(t / 3):.0f}MiB"] for t in range(1200)]
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"steps": steps}))
    server = start_server(simulated_vram_args(timeline))
    out = tmp_path / "browser-test-out"
    result = subprocess.run(
        ["node", "scripts/browser-test.mjs", "--out", str(out), "--chromium", CHROMIUM],
        cwd=UI_BRIDGE,
        env={**os.environ, "HEADROOM_URL": server.base_url, "HEADROOM_TOKEN": server.token},
        capture_output=True,
        text=True,
        timeout=540,
    )
    print(result.stdout)
    print(result.stderr)
    shots = sorted(out.glob("*.png"))
    for shot in shots:
        print(f"screenshot: {shot}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [s.name for s in shots] == [
        "1-ready.png",
        "2-worker-exited.png",
        "3-ready-again.png",
        "4-token-form.png",
        "5-chat.png",
    ]
