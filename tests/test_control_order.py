"""Control actions sent together run one after the other (a real ``headroom serve`` over
the fake engine): a restart and a pause sent at the same time end as the two sent in
turn would, each answer true when given. Before, the restart killed the worker and
answered 202, the pause then stopped the same worker (its answer naming it) and the
exit was taken as a pause's, so the restart asked for was never done nor logged."""

from __future__ import annotations

import http.client
import json
import re

import httpx
from service_harness import ServerProcess, wait_for


def _together(server: ServerProcess, first: str, second: str) -> dict[str, tuple[int, dict]]:
    """POST ``first`` and, before its answer, ``second`` (each on its own connection,
    ``first``'s request on the wire first); both answers, by action."""
    conns = {}
    for action in (first, second):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", f"/api/control/{action}", headers={"Authorization": f"Bearer {server.token}"})
        conns[action] = conn
    answers = {}
    for action, conn in conns.items():
        response = conn.getresponse()
        answers[action] = (response.status, json.loads(response.read()))
        conn.close()
    return answers


def test_a_restart_and_a_pause_sent_together_are_one_after_the_other(start_server):
    server = start_server(fake=True)
    restarted = 0
    for first, second in (("restart", "pause"), ("pause", "restart")) * 2:
        server.wait_ready()
        pid = server.worker_pid()
        answers = _together(server, first, second)
        (restart_status, restart), (pause_status, pause) = answers["restart"], answers["pause"]
        assert pause_status == 202, pause
        if restart_status == 409:  # the pause came first: the restart saw it
            assert restart["error"]["code"] == "engine_paused", restart
            assert f"worker {pid} stopped" in pause["message"], pause
        else:  # the restart came first: the pause saw a restarting engine
            restarted += 1
            assert restart_status == 202 and f"(pid {pid})" in restart["message"], restart
            assert f"worker {pid} stopped" not in pause["message"], pause
            wait_for(lambda pid=pid: re.search(rf"worker {pid} .*restart requested by the control API", server.log()),
                     30, "the restart's exit logged as asked for")
        wait_for(lambda: server.health().json()["status"] == "paused", 30, "paused")
        r = httpx.post(f"{server.base_url}/api/control/resume", timeout=60,
                       headers={"Authorization": f"Bearer {server.token}"})
        assert r.status_code == 202, r.text
    assert restarted, "no round had the restart first: the order above was not exercised"
