"""One meaning of a KV cache size on a model whose sliding-window layers keep a ring (a
new user's finds): ``--kv-cache SIZE`` holds the KV pool's pages and the ring pool beside
them together, split as the plan splits a card's room, at start, in ``headroom plan``, in
the minimum-context and host checks and in the control API. It read as KV pages alone at
start (4 MiB of a tiny Gemma 3 held 15 MiB), as both pools in the control API (the same
4 MiB shrank the pool), and the checks priced pages of every layer or no rings at all.

G3TINY: a tiny random Gemma 3 of 6 layers, 5 sliding over 64 tokens, 8,192 positions:
float32 KV pages of 4 KiB (the global layer) and ring pages of 20 KiB.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest
import torch
from click.testing import CliRunner
from test_gemma3 import GEMMA3_4B
from test_vram_watcher import FakeSupervisor

from engine.common.units import GiB, MiB
from service.cli.commands import main

SLIDING, GLOBAL = "sliding_attention", "full_attention"


@pytest.fixture
def g3tiny(tmp_path, make_tiny_hf_model) -> str:
    make_tiny_hf_model("gemma3", tmp_path, vocab_size=128, layer_types=[SLIDING] * 5 + [GLOBAL], sliding_window=64,
                       max_position_embeddings=8192)
    return str(tmp_path)


@pytest.fixture
def gemma3_4b(tmp_path) -> str:
    """google/gemma-3-4b-it's published config and a weight index whose one shard holds
    one small tensor: plans read no tensors, but refuse a folder without whole weight files."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard.safetensors"}}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "shard.safetensors"))
    return str(tmp_path)


# The rings' sizes below hold a prefill chunk of 2,048 tokens (a GPU's; a CPU engine's own
# default is 256): pinned, so the figures are the same on every device.
CHUNK = 2048


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_MAX_PREFILL_TOKENS": str(CHUNK)})


def plan_json(*args: str, host_may_not_fit: bool = False) -> dict:
    """``headroom plan ... --json``'s object; ``host_may_not_fit``: a CPU plan whose
    weights and pools may not fit the host's available memory now (exit 1, ``fits``
    false: it depends on what else the machine runs) is read too."""
    result = invoke(["plan", *args, "--json"])
    assert result.exit_code in ((0, 1) if host_may_not_fit else (0,)), result.output
    return json.loads(result.stdout)


def test_a_kv_cache_size_is_both_pools_at_start_in_the_plan_and_in_the_control_api(g3tiny):
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.memory.kv_fit import pages_in_bytes
    from engine.worker.process import pool_stats
    from service.control.actions import SupervisorControl

    engine = Engine(EngineConfig(model=g3tiny, device="cpu", kv_cache=4 * MiB, max_prefill_tokens=CHUNK))
    pool, page, ring_page = engine.pool, engine.kv_page_bytes, engine.pool.ring_page_bytes
    assert (page, ring_page) == (4 * 1024, 20 * 1024)
    pages, rings = pool.num_pages - 1, pool.ring_pages - 1  # the null pages apart
    # 4 MiB does not hold the whole context (512 pages) beside rings: the context first,
    # then the rings at their floor of 4 requests (4 x 5 pages + a chunk's 128 + 4).
    assert rings == engine.ring_rule.floor_cap == 152
    assert pages * page + rings * ring_page <= 4 * MiB < (pages + 1) * page + rings * ring_page
    # Both pools' buffers, null pages included (it was 15,355,904 bytes); the KV pool's
    # usable pages as the plan counts them.
    assert engine.info.kv_buffer_bytes == pool.nbytes == (pages + 1) * page + (rings + 1) * ring_page
    assert engine.info.kv_cache_bytes == pages * page
    # headroom plan shows the same pools, on the CPU and on a simulated card.
    cpu = plan_json("--model", g3tiny, "--device", "cpu", "--kv-cache", "4MiB")
    assert (cpu["num_pages"], cpu["kv_ring_pages"]) == (pages, rings)
    assert cpu["kv_pool_bytes"] + cpu["kv_ring_bytes"] == pool.nbytes - page
    card = plan_json("--model", g3tiny, "--device", "cpu", "--device-total", "4GiB", "--kv-cache", "4MiB")
    assert (card["num_pages"], card["kv_ring_pages"]) == (pages, rings)
    # The control API reads the same size as the same pools (it shrank them to 170 + 170).
    stats = pool_stats(engine, engine.stats(), pool.num_pages)
    assert stats is not None and pages_in_bytes(4 * MiB, stats.page_bytes, stats.ring) == pool.num_pages
    sup = FakeSupervisor(stats)
    sup.check_ready = lambda: None  # type: ignore[attr-defined]
    asyncio.run(SupervisorControl(sup, None).set_kv_cache(4 * MiB))  # type: ignore[arg-type]
    assert sup.link.commands[-1][1]["num_pages"] == pool.num_pages
    # A live shrink to 3 MiB keeps both pools within it; 4 MiB again is the start's pools.
    engine.resize_kv_pool(pages_in_bytes(3 * MiB, stats.page_bytes, stats.ring), reason="test")
    assert engine.pool.nbytes - page - ring_page <= 3 * MiB
    engine.resize_kv_pool(pages_in_bytes(4 * MiB, stats.page_bytes, stats.ring), reason="test")
    assert (engine.pool.num_pages - 1, engine.pool.ring_pages - 1) == (pages, rings)


def test_a_kv_cache_below_one_min_context_prices_a_request_at_its_pages_and_its_ring(g3tiny):
    """2 MiB was refused as "1344 tokens (24 KiB a page)", pages of every layer: a request's
    token takes a 4 KiB page of the global layer and its ring 20 KiB pages beside them,
    so 2 MiB holds 85 pages of each (1,360 tokens) and one --min-context (2,048) needs
    128 of each: 3 MiB."""
    result = invoke(["plan", "--model", g3tiny, "--device", "cpu", "--kv-cache", "2MiB"])
    assert result.exit_code == 2, result.output
    assert ("--kv-cache 2 MiB holds 1360 tokens of this model (4 KiB a page of 16 tokens and a ring page of 20 KiB "
            "for the sliding-window layers), less than one --min-context of 2048 tokens: give at least --kv-cache "
            "3MiB") in result.stderr, result.stderr
    for device in (["--device", "cpu"], ["--device", "cpu", "--device-total", "4GiB"]):
        held = plan_json("--model", g3tiny, *device, "--kv-cache", "3MiB")
        assert held["num_pages"] * 16 == 2048


def test_a_kv_cache_on_a_16gib_card_holds_the_rings_within_it(gemma3_4b):
    """Gemma 3 4B in bfloat16: 2 GiB planned 2 GiB of KV pages and 8.8 GiB of rings and
    failed; now the two fit within 2 GiB, and a size the card cannot hold names both
    pools and the most that fits."""
    card = ["--model", gemma3_4b, "--dtype", "bfloat16", "--device-total", "16GiB"]
    fixed = plan_json(*card, "--kv-cache", "2GiB")
    rings = {e["name"]: e for e in fixed["ledger"]}["sliding-window KV rings"]
    ring_page = rings["bytes"] // (fixed["kv_ring_pages"] + 1)
    assert fixed["fits"] and fixed["kv_pool_bytes"] + fixed["kv_ring_pages"] * ring_page <= 2 * GiB
    assert fixed["kv_ring_pages"] == 4 * 65 + 128 + 4  # the floor: 2 GiB does not hold the context beside more
    assert fixed["num_pages"] * 16 > 65_000  # the rest is KV pages
    result = invoke(["plan", *card, "--kv-cache", "8GiB"])
    assert result.exit_code == 1, result.output
    said = re.search(r"--kv-cache 8\.00 GiB is a KV cache of 8\.00 GiB \(a KV pool of [\d.]+ \w+ and sliding-window "
                     r"rings of [\d.]+ \w+\), [\d.]+ \w+ more than the budget of [\d.]+ GiB leaves for it", result.stdout)
    assert said, result.stdout
    most = re.search(r"--kv-cache 8\.00 GiB → (\d+) MiB", result.stdout)
    assert most, result.stdout
    assert invoke(["plan", *card, "--kv-cache", f"{most[1]}MiB"]).exit_code == 0
    assert invoke(["plan", *card, "--kv-cache", f"{int(most[1]) + 2}MiB"]).exit_code == 1


def test_the_cpu_pools_and_the_host_check_count_the_rings(gemma3_4b):
    """On the CPU: the default pool was one context (2.5 GiB) beside the rings' whole
    bound (8.8 GiB); it is now the context first, then the rings' floor, as a card's plan
    does. --kv-cache holds both pools, and the host check counts both."""
    from engine.memory.host import host_memory

    model = ["--model", gemma3_4b, "--dtype", "bfloat16", "--device", "cpu"]
    default = plan_json(*model)
    assert (default["num_pages"], default["kv_ring_pages"]) == (8192, 4 * 65 + 128 + 4)
    ring_page = default["kv_ring_bytes"] // (default["kv_ring_pages"] + 1)
    # The context and the rings' bound (4,864 pages) fit 12 GiB; beside 7.5 GiB of weights
    # that may not fit this host's available memory now, which is not what is tested here.
    fixed = plan_json(*model, "--kv-cache", "12GiB", host_may_not_fit=True)
    assert fixed["kv_ring_pages"] == 64 * 65 + 128 + 64 + 8 * 64
    assert fixed["kv_pool_bytes"] + fixed["kv_ring_bytes"] - ring_page <= 12 * GiB
    total, available = host_memory()
    room = available if available is not None else total
    page = fixed["kv_bytes_per_token"] * 16
    if room < 6 * GiB:
        pytest.skip("the rings' bound needs about 9 GiB beside the pages")
    pages = (room - 4 * GiB) // page  # the KV pages alone fit, with the rings (8.6 GiB) they do not
    result = invoke(["plan", *model, "--num-pages", str(pages)])
    assert result.exit_code == 2, result.output
    assert f"--num-pages {pages} (a KV cache of " in result.stderr and "does not fit the host's memory" in result.stderr
