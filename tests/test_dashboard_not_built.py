"""A source tree where nobody built the dashboard's script (``app.js`` is not committed):
``/ui/`` answers a page naming the fix instead of a blank page or a 500, ``app.js`` an
error saying the same, the page is served once it is built (no restart), the API
serves meanwhile, and ``headroom doctor`` warns with the fix. :func:`build_dashboard`
without npm says what to install."""

from __future__ import annotations

import pytest
from litestar import Litestar, get
from litestar.testing import TestClient

from service.common import resources
from service.doctor import OK, WARN, Context, _check_dashboard
from service.http.dashboard import UI_CSP, dashboard_router

FIX = "`make dashboard` (or `cd ui-bridge && npm ci && npm run build:dashboard`)"


@get("/api/health")
async def health() -> dict[str, str]:
    return {"status": "ready"}


def test_ui_names_the_build_while_app_js_is_missing(tmp_path):
    (tmp_path / "index.html").write_text('<script type="module" src="./app.js"></script>')
    app = Litestar(route_handlers=[dashboard_router(tmp_path), health], logging_config=None)
    with TestClient(app) as client:
        page = client.get("/ui/")
        assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == UI_CSP
        assert "The dashboard is not built" in page.text and "app.js missing" in page.text
        assert "make dashboard" in page.text and "npm run build:dashboard" in page.text
        script = client.get("/ui/app.js")
        assert script.status_code == 503
        assert "make dashboard" in script.json()["error"]["message"]
        assert client.get("/api/health").json() == {"status": "ready"}

        (tmp_path / "app.js").write_text("// built\n")  # built while the service runs
        assert client.get("/ui/").status_code == 200
        script = client.get("/ui/app.js")
        assert script.status_code == 200 and script.text == "// built\n"
        assert client.get("/ui/nope.js").status_code == 404


def test_doctor_warns_with_the_fix_while_the_dashboard_is_not_built(tmp_path, monkeypatch):
    folder = tmp_path / "ui-bridge" / "dashboard"
    folder.mkdir(parents=True)
    (folder / "index.html").write_text("")
    monkeypatch.setattr(resources, "PACKAGED_DIR", tmp_path / "no-wheel")
    monkeypatch.setattr(resources, "SOURCE_ROOT", tmp_path)
    check = _check_dashboard(Context())
    assert check.status == WARN and check.fix == FIX
    assert check.detail == f"not built: app.js missing in {folder} (/ui says so; the API serves)"
    (folder / "app.js").write_text("")
    assert _check_dashboard(Context()).status == OK


def test_building_without_npm_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(RuntimeError, match="npm is missing") as missing:
        resources.build_dashboard(tmp_path)
    assert "apt-get install nodejs npm" in str(missing.value) and FIX in str(missing.value)
