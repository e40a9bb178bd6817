"""``headroom tray``: the state logic on recorded event sequences, the icons, the menu's
actions against a running service, and the real tray process under Xvfb following a
restart, a worker kill and a pause.

The sequences in ``tests/data/tray/`` were recorded from ``/api/events`` of a running
service (the fake engine, CPU mode); the desktop states (waiting for memory, paused,
idle) are written by hand in the shape the service sends.

The Xvfb test needs the ``Xvfb`` binary (``apt-get install xvfb``; ``make test`` installs
it) and pystray with Pillow (the ``test`` extra); it skips, saying which, without them.
It runs the ``headroom tray`` command on a bare Xvfb display whose tray is
``tests/xtray_host.py``, and reads the icon's colour from screenshots, which it saves
with the drawn icon of every state in its output folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_harness import ServerProcess, serving

from service.tray.state import TOOLTIP_MAX, IconState, TrayModel, TrayView

DATA = Path(__file__).parent / "data" / "tray"


def recorded(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def replay(frames: list[dict]) -> list[TrayView]:
    model = TrayModel()
    return [model.connection("connecting"), *(model.apply(f) for f in frames)]


def icons(views: list[TrayView]) -> list[IconState]:
    """The icon's states in order, each change once."""
    out: list[IconState] = []
    for v in views:
        if not out or out[-1] is not v.icon:
            out.append(v.icon)
    return out


def health(status: str, reason: str | None = None, **more) -> dict:
    return {"type": "health", "seq": 0, "ts": 0.0, "status": status, "reason": reason, **more}


# -- the state logic ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["restart_by_control", "worker_sigkill"])
def test_a_restart_or_a_kill_goes_restarting_then_ready(name):
    views = replay(recorded(name))
    assert icons(views) == [IconState.OFFLINE, IconState.READY, IconState.RESTARTING, IconState.READY]
    last = views[-1]
    assert last.status == "ready" and not last.paused
    assert last.tooltip.startswith("headroom: ready\n")
    # CPU mode: the host's available RAM stands for the headroom; the pool from the engine.
    assert "RAM free " in last.tooltip and "KV pool " in last.tooltip
    restarting = next(v for v in views if v.icon is IconState.RESTARTING)
    assert restarting.status_line == "headroom: restarting" and "KV pool" not in restarting.tooltip


def test_requests_in_flight_show_busy():
    views = replay(recorded("busy_request"))
    assert icons(views) == [IconState.OFFLINE, IconState.READY, IconState.BUSY, IconState.READY]
    busy = next(v for v in views if v.icon is IconState.BUSY)
    assert busy.tooltip.startswith("headroom: busy (1 in flight)")


def test_the_desktop_states_show_with_their_reason_and_unknown_ones_by_name():
    snapshot = recorded("busy_request")[0]
    why = "needs 2.10 GiB, 0.90 GiB free; firefox (pid 4242) holds 3.00 GiB"
    frames = [
        snapshot,
        health("waiting_for_memory", why, retry_after_s=2),
        health("ready"),
        health("paused", "paused through the control API"),
        health("idle", "unloaded after 5 min idle"),
        health("waiting_for_gpu", "CUDA failed to initialise (error 999): reload nvidia_uvm"),
        health("reticulating_splines", "a state from a newer service"),
        health("failed", "crash loop: the worker exited 5 times in 60 s"),
    ]
    views = replay(frames)[1:]
    assert [v.icon for v in views] == [
        IconState.READY,
        IconState.WAITING,
        IconState.READY,
        IconState.PAUSED,
        IconState.PAUSED,
        IconState.WAITING,
        IconState.UNKNOWN,
        IconState.FAILED,
    ]
    waiting = views[1]
    assert waiting.status_line == f"headroom: waiting for memory: {why}"
    assert why in waiting.tooltip and "KV pool" not in waiting.tooltip
    assert [v.paused for v in views[2:5]] == [False, True, True]  # the menu offers Resume
    assert views[4].status_line == "headroom: idle (model unloaded): unloaded after 5 min idle"
    assert views[5].status_line.startswith("headroom: waiting for the GPU: CUDA failed")
    assert views[6].status == "reticulating_splines"
    assert views[6].status_line == "headroom: reticulating splines: a state from a newer service"


def test_connection_states_and_the_tooltip_limit():
    model = TrayModel()
    assert model.view.icon is IconState.OFFLINE and "connecting" in model.view.tooltip
    model.apply(recorded("busy_request")[0])
    assert model.connection("connection refused (is `headroom serve` running?)").tooltip == (
        "headroom: service not reachable: connection refused (is `headroom serve` running?)"
    )
    assert "token was refused" in model.connection("unauthorized").status_line
    model.apply(health("waiting_for_memory", "x" * 500))
    assert model.view.icon is IconState.WAITING and len(model.view.tooltip) == TOOLTIP_MAX
    assert model.view.tooltip.endswith("...")
    # A menu action's answer shows until the next one.
    model.apply(health("ready"))
    assert model.note("pause failed (404): no such route").tooltip.endswith(
        "pause failed (404): no such route"
    )


def test_gpu_tooltip_shows_the_headroom_and_the_pools_free_share():
    model = TrayModel()
    model.apply(health("ready"))
    model.apply({"type": "engine", "info": {"kv_cache_bytes": 3 << 30}})
    model.apply({"type": "counters", "in_flight": 0, "engine": {"free_pages": 750, "total_pages": 1000}})
    view = model.apply(
        {"type": "vram", "source": "nvml", "headroom_bytes": 5 << 29, "host": None, "future_field": 1}
    )
    assert view.tooltip == "headroom: ready\nheadroom 2.50 GiB\nKV pool 3.00 GiB (75% free)"
    assert model.apply({"type": "some_new_event", "seq": 9}) == view


def test_each_state_has_its_own_icon(tmp_path):
    pytest.importorskip("PIL", reason="the icons need Pillow (the tray extra)")
    from service.tray.icons import COLOURS, draw_icon

    images = {state: draw_icon(state, 32) for state in IconState}
    assert len({img.tobytes() for img in images.values()}) == len(IconState)
    for state, img in images.items():
        assert img.size == (32, 32) and img.mode == "RGBA"
        assert img.getpixel((0, 0))[3] == 0  # a round icon: transparent corners
        r, g, b, _ = img.getpixel((16, 4))  # the rim is the state's colour
        assert max(abs(r - COLOURS[state][0]), abs(g - COLOURS[state][1]), abs(b - COLOURS[state][2])) < 40
        img.save(tmp_path / f"icon-{state.value}.png")
    print(f"icons: {tmp_path}")


# -- against a running service ---------------------------------------------------------------

needs_pystray = pytest.mark.skipif(
    importlib.util.find_spec("pystray") is None or importlib.util.find_spec("PIL") is None,
    reason="pystray and Pillow are missing (pip install 'headroom[tray]')",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    """One service (the fake engine on a simulated card, whose desktop reserve the menu
    sets) for the menu and the Xvfb tests: each leaves it ready."""
    proc = ServerProcess(tmp_path_factory.mktemp("tray"), fake=True, fake_model_dir=default_model_dir,
                         args=["--vram-source", "simulated", "--device-total", "8GiB"])
    yield from serving(proc)


def _tray_app(server, monkeypatch, **kwargs):
    # No display needed for the menu's logic: pystray's dummy backend.
    monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    for name in [m for m in sys.modules if m == "pystray" or m.startswith("pystray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "service.tray.app", raising=False)
    from service.tray.app import TrayApp

    return TrayApp(server.base_url, "127.0.0.1", server.port, server.token, **kwargs)


@pytest.mark.slow
@needs_pystray
def test_the_menu_acts_on_the_service_and_shows_what_it_answered(server, monkeypatch):
    opened: list[str] = []
    commands: list[list[str]] = []

    def run_command(args, **_):
        commands.append(args)
        if args[-1] == "status":
            return subprocess.CompletedProcess(args, 3, "", "")
        return subprocess.CompletedProcess(args, 2, "", "Error: No such command 'service'.\n")

    app = _tray_app(server, monkeypatch, open_url=opened.append, run_command=run_command)
    app.follower.start()
    try:
        app.wait_for(lambda v: v.icon is IconState.READY, 60)
        app.open_dashboard()
        assert opened == [f"http://127.0.0.1:{server.port}/ui/#token={server.token}"]

        old = server.worker_pid()
        assert app.restart().ok
        app.wait_for(lambda v: v.icon is IconState.RESTARTING, 60)
        app.wait_for(lambda v: v.icon is IconState.READY, 120)
        assert server.worker_pid() != old

        answer = app.set_reserve(2 << 30)
        assert answer.ok and answer.text == "reserve: the desktop reserve is now 2.00 GiB"
        assert app.reserve == 2 << 30

        # Game mode: pause gives the memory back, a second click resumes.
        answer = app.toggle_pause()
        assert answer.ok, answer.text
        app.wait_for(lambda v: v.icon is IconState.PAUSED and v.paused, 60)
        assert app.toggle_pause().ok
        app.wait_for(lambda v: v.icon is IconState.READY, 120)

        assert not app.start_at_login  # `service status` did not say installed
        answer = app.toggle_start_at_login()
        assert not answer.ok and not app.start_at_login
        assert answer.text == "start at login failed: headroom service install: Error: No such command 'service'."
        assert commands[-1][-2:] == ["service", "install"]
        monkeypatch.setattr("service.tray.app.headroom_command", lambda: None)
        answer = app.toggle_start_at_login()
        assert not answer.ok and "no `headroom` command found" in answer.text
        assert answer.text in app.view.tooltip or app.view.tooltip.endswith("...")
    finally:
        app.follower.stop()
    assert not app.follower._thread.is_alive()


# -- the real tray under Xvfb -----------------------------------------------------------------


def _start_xvfb() -> tuple[subprocess.Popen, str]:
    read, write = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write), "-screen", "0", "320x200x24", "-nolisten", "tcp"],
        pass_fds=(write,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write)
    with os.fdopen(read) as f:
        number = f.readline().strip()
    if not number:
        proc.kill()
        pytest.fail("Xvfb did not start (no display number)")
    return proc, f":{number}"


def _classify(image) -> IconState | None:
    """The state whose colour is nearest the icon's rim (above the marks), or None when
    no state's colour is near (nothing docked yet: the tray's background)."""
    from service.tray.icons import COLOURS

    w, h = image.size
    pixel = image.convert("RGB").getpixel((w // 2, h // 8))

    def distance(state: IconState) -> int:
        return sum((x - y) ** 2 for x, y in zip(pixel, COLOURS[state], strict=True))

    nearest = min(COLOURS, key=distance)
    return nearest if distance(nearest) < 40**2 else None


class _Screen:
    """Screenshots of the docked icon, each new state's saved as it first shows."""

    def __init__(self, host, out: Path, tray: subprocess.Popen) -> None:
        self.host = host
        self.out = out
        self.tray = tray
        self.seen: list[IconState] = []

    def wait_for(self, states: list[IconState], timeout_s: float, what: str) -> None:
        """Wait until the icon has shown ``states`` in this order (from now)."""
        want = list(states)
        deadline = time.monotonic() + timeout_s
        while want:
            assert self.tray.poll() is None, f"{what}: headroom tray exited ({self.tray.returncode})"
            shot = self.host.screenshot()
            state = _classify(shot)
            if state is not None and (not self.seen or self.seen[-1] is not state):
                self.seen.append(state)
                shot.resize((96, 96)).save(self.out / f"{len(self.seen):02d}-{state.value}.png")
            if state is want[0]:
                want.pop(0)
                continue
            assert time.monotonic() < deadline, f"{what}: the tray showed {self.seen}, not {states}"
            time.sleep(0.05)


@pytest.mark.slow
@needs_pystray
@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="no Xvfb (apt-get install xvfb)")
def test_tray_under_xvfb_follows_restart_kill_and_pause(server, tmp_path):
    pytest.importorskip("Xlib", reason="python-xlib is missing (pystray brings it on Linux)")
    from xtray_host import TrayHost

    from service.tray.icons import draw_icon

    out = tmp_path / "tray"
    out.mkdir()
    for state in IconState:
        draw_icon(state, 64).save(out / f"icon-{state.value}.png")
    xvfb, name = _start_xvfb()
    host = TrayHost(name)
    env = {
        **server.env,
        "DISPLAY": name,
        "PYSTRAY_BACKEND": "xorg",
        "HEADROOM_PORT": str(server.port),
    }
    log = open(tmp_path / "tray.log", "wb")  # noqa: SIM115 - closed below
    tray = subprocess.Popen(
        [*server.command[: server.command.index("serve")], "tray"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    screen = _Screen(host, out, tray)
    auth = {"Authorization": f"Bearer {server.token}"}
    try:
        httpx.get(server.base_url + "/api/health").raise_for_status()
        screen.wait_for([IconState.READY], 60, "the service is ready")
        assert host.docked, "the tray icon never asked to dock"

        httpx.post(server.base_url + "/api/control/restart", headers=auth).raise_for_status()
        screen.wait_for([IconState.RESTARTING, IconState.READY], 120, "a restart asked for")

        os.kill(server.worker_pid(), signal.SIGKILL)
        screen.wait_for([IconState.RESTARTING, IconState.READY], 120, "a killed worker")

        httpx.post(server.base_url + "/api/control/pause", headers=auth).raise_for_status()
        screen.wait_for([IconState.PAUSED], 60, "a pause")
        httpx.post(server.base_url + "/api/control/resume", headers=auth).raise_for_status()
        screen.wait_for([IconState.READY], 120, "a resume")
    finally:
        tray.send_signal(signal.SIGTERM)
        try:
            tray.wait(15)
        except subprocess.TimeoutExpired:
            tray.kill()
            tray.wait()
        log.close()
        host.close()
        xvfb.terminate()
        xvfb.wait(15)
        print(f"tray screenshots: {out}: {[p.name for p in sorted(out.iterdir())]}")
        print((tmp_path / "tray.log").read_text(errors="replace"))


def test_the_tray_command_names_its_extra_when_pystray_is_missing(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from service.cli.commands import main

    env = {"HEADROOM_CONFIG": os.devnull, "HEADROOM_CONFIG_DIR": str(tmp_path)}
    assert "pip install 'headroom[tray]'" in CliRunner().invoke(main, ["tray", "--help"], env=env).output
    monkeypatch.setitem(sys.modules, "pystray", None)  # an import of it fails
    monkeypatch.delitem(sys.modules, "service.tray.app", raising=False)
    result = CliRunner().invoke(main, ["tray"], env=env)
    assert result.exit_code != 0
    assert "the tray needs pystray and Pillow: pip install 'headroom[tray]'" in result.output


@needs_pystray
@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="no Xvfb (apt-get install xvfb)")
def test_the_tray_without_a_tray_host_says_so_in_one_line_and_exits(tmp_path):
    """A display without a system tray: one line naming the fix and exit 1, not an
    invisible icon and a traceback for each update."""
    pytest.importorskip("Xlib", reason="python-xlib is missing (pystray brings it on Linux)")
    from service_harness import headroom_command

    xvfb, name = _start_xvfb()
    try:
        env = {**os.environ, "DISPLAY": name, "PYSTRAY_BACKEND": "xorg", "HEADROOM_CONFIG": os.devnull,
               "HEADROOM_CONFIG_DIR": str(tmp_path)}
        result = subprocess.run([*headroom_command(), "tray"], env=env, capture_output=True, text=True, timeout=120)
    finally:
        xvfb.terminate()
        xvfb.wait(15)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"the X display {name} has no system tray" in line and "AppIndicator" in line
