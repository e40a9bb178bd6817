"""``headroom serve --device-limit 16GiB`` on a larger GPU is a 16 GiB card while it
serves, as it is for the plan at start: another process takes 6 GiB (which the real
card has to spare), the watcher reads it against the 16 GiB, the KV pool shrinks and,
once the memory is freed, grows back to the plan; no request fails, and ``/api/status``
states the rule in force.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from test_service_replan import StreamingClients, wait_for

GiB = 1 << 30
LIMIT = 16 * GiB
TAKEN_GIB = 6

# Takes TAKEN_GIB on the GPU, says so, frees it when told on stdin, says so, and exits:
# a process that freed its tensors still holds its CUDA context (about 0.5 GiB on an
# H200), which on a 16 GiB card is memory the pool cannot have back until it ends.
HOG = r"""
import sys, torch
x = torch.empty(int(sys.argv[1]) << 30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("took", flush=True)
sys.stdin.readline()
del x
torch.cuda.empty_cache()
print("freed", flush=True)
"""


def test_device_limit_is_a_card_of_that_size_while_serving(start_server):
    assert torch.cuda.get_device_properties(0).total_memory > LIMIT + 2 * TAKEN_GIB * GiB
    server = start_server(["--device-limit", "16GiB", "--max-running-requests", "16", "--replan-hold", "1"])
    http = server.client()
    status = wait_for(lambda: (s := http.get("/api/status").json())["vram"] is not None and s, 30, "a sample")
    vram = status["vram"]
    assert vram["source"] == "nvml", vram
    assert (vram["total_bytes"], vram["device_limit_bytes"]) == (LIMIT, LIMIT)
    assert "a card of 16.00 GiB" in vram["memory_rule"]
    planned = status["engine"]["info"]["num_pages"]
    page_bytes = status["engine"]["info"]["kv_cache_bytes"] // planned

    clients = StreamingClients(server.base_url, 8)
    pages = lambda: http.get("/api/status").json()["engine"]["info"]["num_pages"]  # noqa: E731
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(TAKEN_GIB)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "took"
        least = wait_for(lambda: (planned - pages()) * page_bytes >= (TAKEN_GIB - 1) * GiB and pages(), 60,
                         "the pool to give back what the other process took")
        hog.stdin.write("free\n")
        hog.stdin.flush()
        assert hog.stdout.readline().strip() == "freed"
        hog.wait(timeout=60)
        wait_for(lambda: pages() == planned, 120, "the pool to grow back to the plan")
    finally:
        hog.kill()
        hog.wait()
        results = clients.stop()
    final = http.get("/api/status").json()
    http.close()
    failures = [why for ok, why in results if not ok]
    assert results and not failures, failures
    actions = [r["action"] for r in final["replans"]]
    assert "shrink_kv" in actions and "grow_kv" in actions, actions
    print(f"pool pages {planned} -> {least} -> {final['engine']['info']['num_pages']}; "
          f"{len(results)} requests, all ok; replans {actions}")
