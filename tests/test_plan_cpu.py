"""``headroom plan --device cpu``: no plan is fitted on the CPU; the command shows what
the engine holds there instead, and says what GPU-only settings do there. Every test
depends on ``default_model_dir`` (the embedded default model converted once a session)."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from service.cli.commands import main


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull})


def test_plan_on_the_cpu_shows_what_the_engine_holds(default_model_dir):
    """No plan is fitted on the CPU: the weights as the CPU loads them (the GGUF's blocks)
    and the pool the engine makes, both as the engine sizes them."""
    import torch

    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    result = invoke(["plan", "--device", "cpu", "--max-model-len", "4096", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    engine = Engine(EngineConfig(device="cpu", max_model_len=4096))
    # Both count the float32 RoPE table, as every plan's weights do.
    assert got["weight_bytes"] == engine.info.weight_bytes
    assert got["weight_source"].startswith("exact, GGUF: ") and "Q4_1 blocks" in got["weight_source"]
    assert got["num_pages"] == engine.pool.num_pages - 1  # the engine's own count holds the null page
    assert got["kv_pool_bytes"] == got["num_pages"] * got["page_size"] * got["kv_bytes_per_token"]
    assert got["fits"] is True and "kv_pages" not in got
    assert got["max_context_tokens"] == 4096 and got["kv_cache_dtype"] == str(engine.kv_dtype).removeprefix("torch.")
    assert 0 < got["host_available_bytes"] <= got["host_total_bytes"]
    assert got["dtype"] == "float32" and engine.dtype == torch.float32
    table = invoke(["plan", "--device", "cpu"]).stdout
    assert "no plan is fitted on the CPU" in table and "resident only where written" in table
    assert "--device-total SIZE plans the pool for a budget" in table
    assert "no effect on the CPU" not in table


def test_plan_on_the_cpu_says_what_gpu_only_settings_do_there(default_model_dir):
    """``--cpu-layers`` and ``--device-limit`` shape a GPU's plan only: on the CPU the
    table says they change nothing there and how to plan for a card instead."""
    result = invoke(["plan", "--device", "cpu", "--cpu-layers", "3", "--device-limit", "2GiB"])
    assert result.exit_code == 0, result.output
    note = result.stdout.splitlines()[-1]
    assert note.startswith("--cpu-layers 3 and --device-limit 2.00 GiB: no effect on the CPU"), note
    assert "--device cuda --device-total SIZE" in note
    got = json.loads(invoke(["plan", "--device", "cpu", "--cpu-layers", "auto", "--json"]).stdout)
    assert got["gpu_only"] == []


def test_plan_json_names_its_pool_and_fit_alike_on_the_cpu_and_a_simulated_card(default_model_dir):
    """``plan --json`` on the CPU said ``kv_pages`` and had no ``fits`` (which the help
    promises), where a simulated card's plan has ``num_pages`` and ``fits``: both carry
    the same keys now, ``num_pages`` counted alike (usable pages)."""
    cpu = json.loads(invoke(["plan", "--device", "cpu", "--json"]).stdout)
    card = json.loads(invoke(["plan", "--device-total", "8GiB", "--json"]).stdout)
    for got in (cpu, card):
        assert got["fits"] is True and got["num_pages"] > 0 and got["kv_pool_bytes"] > 0, got
    assert "kv_pages" not in cpu and "kv_pages" not in card
    assert cpu["kv_pool_bytes"] == cpu["num_pages"] * cpu["page_size"] * cpu["kv_bytes_per_token"]


def test_no_gpu_only_note_on_a_simulated_card(capsys):
    """With ``--device-total`` the CPU plays a card that ``--cpu-layers`` splits and
    ``--device-limit`` limits: serve said "no effect on the CPU" and then used both."""
    from service.cli.precheck import note_gpu_only_settings

    note_gpu_only_settings("cpu", "5", 2 << 30, device_total=6 << 30)
    assert capsys.readouterr().err == ""
    note_gpu_only_settings("cpu", "5", None, device_total=None)
    assert "--cpu-layers 5: no effect on the CPU" in capsys.readouterr().err
