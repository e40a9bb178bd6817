"""``headroom plan --kv-cache SIZE`` and ``--num-pages N``: the ledger of the KV pool a
setting fixes, as ``headroom serve`` runs it with that setting (no plan fitted: the pool
is the setting's). Every test depends on ``default_model_dir`` (the embedded default
model converted once a session)."""

from __future__ import annotations

import json
import os
import re

from click.testing import CliRunner

from service.cli.commands import main

CARD = ["--device-total", "6GiB", "--device-free", "5.5GiB"]


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull})


def _plan(*args: str) -> dict:
    result = invoke(["plan", *CARD, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_shows_the_pool_kv_cache_fixes_as_the_engine_sizes_it(default_model_dir):
    from engine.common.config import EngineConfig
    from engine.common.units import GiB, MiB
    from engine.core.engine import Engine

    planned, fixed = _plan(), _plan("--kv-cache", "512MiB")
    engine = Engine(EngineConfig(device="cpu", device_total=6 * GiB, device_free=int(5.5 * GiB), kv_cache=512 * MiB))
    assert engine.plan is None  # a fixed pool: serve fits no plan
    assert fixed["num_pages"] == engine.pool.num_pages - 1 < planned["num_pages"]  # the null page apart
    page_bytes = fixed["kv_bytes_per_token"] * fixed["page_size"]
    pool = {e["name"]: e for e in fixed["ledger"]}["KV cache pool"]
    assert pool["bytes"] == fixed["kv_pool_bytes"] == fixed["num_pages"] * page_bytes <= 512 * MiB
    assert f"fixed by --kv-cache 512 MiB (the plan would give {planned['num_pages']})" in pool["source"]
    assert fixed["fits"] and fixed["fixed_bytes"] == planned["fixed_bytes"]
    assert fixed["budget_bytes"] == planned["budget_bytes"]
    table = invoke(["plan", *CARD, "--kv-cache", "512MiB"])
    assert table.exit_code == 0, table.output
    assert f"{fixed['num_pages']} pages of 720 KiB, fixed by --kv-cache 512 MiB" in table.stdout
    assert table.stdout.rstrip().endswith("fits: yes")


def test_plan_shows_the_pool_num_pages_fixes_and_the_context_it_gives(default_model_dir):
    fixed = _plan("--num-pages", "100")
    assert fixed["num_pages"] == 99 and fixed["max_context_tokens"] == 99 * 16
    assert fixed["context_note"] == "context 8,192 -> 1,584 tokens: the KV pool fixed by --num-pages 100"
    assert fixed["fits"]
    # On the CPU (no plan there either), the pool the engine holds is the same.
    cpu = invoke(["plan", "--device", "cpu", "--num-pages", "100", "--json"])
    assert cpu.exit_code == 0, cpu.output
    assert json.loads(cpu.stdout)["num_pages"] == 99


def test_a_fixed_pool_larger_than_the_budget_leaves_fails_with_the_size_that_fits(default_model_dir):
    result = invoke(["plan", *CARD, "--kv-cache", "5GiB"])
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert "fits: no" in out
    assert "--kv-cache 5.00 GiB is a KV pool of 5.00 GiB" in out
    assert "--kv-cache unset: the plan sizes the pool" in out
    most = re.search(r"--kv-cache 5\.00 GiB → (\d+) MiB", out)
    assert most, out
    # The size it names fits, and more than a page (720 KiB) beyond it does not.
    assert invoke(["plan", *CARD, "--kv-cache", f"{most[1]}MiB"]).exit_code == 0
    assert invoke(["plan", *CARD, "--kv-cache", f"{int(most[1]) + 2}MiB"]).exit_code == 1
    pages = invoke(["plan", *CARD, "--num-pages", "100000"])
    assert pages.exit_code == 1 and "--num-pages 100000 → " in pages.stdout


def test_a_fixed_pool_of_a_sliding_window_model_prices_the_rings_the_engine_holds(tmp_path, make_tiny_hf_model):
    """A tiny Gemma 3 (sliding-window layers keep their window in a ring pool) with
    ``--num-pages`` on a simulated card: the ring pool follows the fixed pool's pages,
    with no plan's cap, and the ledger prices the pages the engine holds."""
    from engine.commands.plan import plan_with_pool
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    make_tiny_hf_model("gemma3", tmp_path, vocab_size=128, max_position_embeddings=1024)
    knobs = dict(model=str(tmp_path), device="cpu", page_size=4, max_prefill_tokens=16, max_running_requests=16,
                 device_total=4 << 30)
    for pages in (20, 400):  # below the rings' bound (68 pages and 16 of checkpoints), and above it
        config = EngineConfig(num_pages=pages, **knobs)
        plan, fixed = plan_with_pool(config)
        assert fixed is not None and fixed.setting == f"--num-pages {pages}"
        engine = Engine(config)
        assert engine.plan is None
        assert plan.num_pages == engine.allocator.num_usable == pages - 1
        assert plan.kv_ring_pages == engine.ring.allocator.num_usable > 0
        rings = next(e for e in plan.ledger if e.name == "sliding-window KV rings")
        assert rings.bytes % (plan.kv_ring_pages + 1) == 0  # the null page among them
        assert f"following the {pages - 1} pages of the fixed KV pool" in rings.source
    assert plan.fits


def test_both_fixed_sizes_at_once_are_refused_naming_the_choice():
    """``--kv-cache`` and ``--num-pages`` both fix the pool: one silently won over the
    other; now ``plan`` and ``serve`` refuse the pair (exit 2), naming both."""
    for command in ("plan", "serve"):
        result = CliRunner().invoke(main, [command, "--kv-cache", "2GiB", "--num-pages", "100"],
                                    env={"HEADROOM_CONFIG": os.devnull})
        assert result.exit_code == 2, result.output
        assert "--num-pages: does not go with --kv-cache" in result.stderr and "give one of the two" in result.stderr


def test_num_pages_below_one_min_context_is_taken_with_a_warning_naming_the_fix(default_model_dir):
    """``--num-pages 4`` holds 48 tokens, less than one ``--min-context`` (2048): taken (small
    pools serve short requests), with a warning naming the numbers and the fix, on the
    CPU and on a simulated card; none once ``--min-context`` or ``--max-model-len`` fits it."""
    warning = ("warning: --num-pages 4 holds 48 tokens (3 pages of 16 tokens, the null page apart), less than one "
               "--min-context of 2048 tokens: a request whose prompt and max tokens pass 48 tokens is refused; give "
               "--num-pages 129 or more, or lower --min-context (or --max-model-len) to 48")
    for device in (["--device", "cpu"], CARD):
        result = invoke(["plan", *device, "--num-pages", "4"])
        assert result.exit_code == 0, result.output
        assert warning in result.stdout.splitlines(), result.stdout
    as_json = invoke(["plan", "--device", "cpu", "--num-pages", "4", "--json"])
    assert json.loads(as_json.stdout)["pool_warning"] == warning.removeprefix("warning: ")
    for enough in (["--min-context", "48"], ["--max-model-len", "48"], ["--num-pages", "129"]):
        result = invoke(["plan", "--device", "cpu", "--num-pages", "4", *enough])
        assert result.exit_code == 0 and "warning" not in result.stdout, result.output


def test_a_fixed_pool_larger_than_the_hosts_memory_is_refused_by_plan_as_by_serve(default_model_dir):
    """On the CPU with no simulated card the KV pool is host memory: ``--kv-cache 1TiB`` (or
    twice this machine's memory, if larger) was planned as "at most 1 TiB of 23 GiB" and
    served; ``plan`` and ``serve`` now both refuse it (exit 2) in the same words, naming
    what is available and the most it holds, and so for ``--num-pages``."""
    from engine.memory.host import host_memory

    size = f"{max(1 << 40, 2 * host_memory()[0]) >> 30}GiB"
    for setting in (["--kv-cache", size], ["--num-pages", "100000000"]):
        said = []
        for command in (["plan"], ["serve", "--port", "0"]):
            result = invoke([*command, "--device", "cpu", *setting])
            assert result.exit_code == 2, result.output
            said.append(re.sub(r"[\d.]+ GiB is available \(of [\d.]+ GiB\), less [^;]+; give at most --\S+ \d+", "N", result.stderr))
            assert "does not fit the host's memory: " in result.stderr and "give at most" in result.stderr
        assert said[0] == said[1], said
        assert "listening" not in result.output
