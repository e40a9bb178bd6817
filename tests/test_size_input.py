"""Sizes a new user writes to ``headroom plan``, from the flag, the environment and
config.toml alike: a fractional number of bytes (``--reserve 1.5`` was a 0.0 MiB reserve)
and a bare number too small to be meant (``--device-limit 6`` was a 6-byte card) are
refused naming the unit; a whole float (``1e9``) is bytes from every source; a refused
``--kv-cache`` is printed below the least size it names; and ``plan --json`` carries
the fixes the text lists for a fixed pool that does not fit."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from service.cli.commands import main

CARD = ["--device-total", "6GiB"]


def invoke(args: list[str], tmp_path, config: str = "", env: dict[str, str] | None = None):
    path = tmp_path / "config.toml"
    path.write_text(config)
    return CliRunner().invoke(main, ["plan", *CARD, *args], env={"HEADROOM_CONFIG": str(path), **(env or {})})


@pytest.mark.parametrize(("source", "needle"), [
    ({"args": ["--reserve", "1.5"]}, "--reserve: 1.5 is not a whole number of bytes: write 1.5GiB"),
    ({"env": {"HEADROOM_RESERVE": "1.5"}}, "HEADROOM_RESERVE: reserve: 1.5 is not a whole number of bytes: write 1.5GiB"),
    ({"config": "reserve = 1.5\n"}, "reserve: 1.5 is not a whole number of bytes: write 1.5GiB"),
    ({"config": "kv_cache = 5.5\n"}, "kv_cache: 5.5 is not a whole number of bytes: write 5.5GiB"),
    ({"args": ["--kv-cache", "5.5"]}, "--kv-cache: 5.5 is not a whole number of bytes: write 5.5GiB"),
    ({"args": ["--device-limit", "6"]}, "--device-limit: 6 without a unit is 6 bytes, less than 1 MiB; did you mean 6GiB?"),
    ({"args": ["--reserve", "2"]}, "--reserve: 2 without a unit is 2 bytes, less than 1 MiB; did you mean 2GiB?"),
    ({"config": "reserve = 2\n"}, "reserve: 2 without a unit is 2 bytes, less than 1 MiB; did you mean 2GiB?"),
    ({"args": ["--kv-cache", "1000"]}, "--kv-cache: 1000 without a unit is 1000 bytes"),
])
def test_a_size_no_one_means_is_refused_naming_the_unit(tmp_path, source, needle):
    result = invoke(source.get("args", []), tmp_path, source.get("config", ""), source.get("env"))
    assert result.exit_code == 2, result.output
    assert needle in result.stderr, result.stderr


@pytest.mark.parametrize("source", [
    {"args": ["--kv-cache", "1e9"]}, {"config": "kv_cache = 1e9\n"}, {"env": {"HEADROOM_KV_CACHE": "1e9"}},
    {"config": "kv_cache = 1000000000.0\n"},
])
def test_a_whole_float_is_bytes_from_every_source(tmp_path, source):
    result = invoke([*source.get("args", []), "--json"], tmp_path, source.get("config", ""), source.get("env"))
    assert result.exit_code == 0, result.output
    pool = next(e for e in json.loads(result.stdout)["ledger"] if e["name"] == "KV cache pool")
    assert "fixed by --kv-cache 953.67 MiB" in pool["source"], pool


@pytest.mark.parametrize("args", [["--reserve", "0"], ["--reserve", "2B"], ["--reserve", "auto"]])
def test_a_reserve_of_0_or_in_bytes_on_purpose_is_taken(tmp_path, args):
    result = invoke(args, tmp_path)
    assert result.exit_code == 0, result.output


def test_a_refused_kv_cache_reads_below_the_least_it_names(tmp_path):
    """90 MiB less a byte was "--kv-cache 90 MiB holds 2032 tokens ... give at least 90MiB"."""
    result = invoke(["--kv-cache", str(90 * 2**20 - 1)], tmp_path)
    assert result.exit_code == 2, result.output
    assert "--kv-cache 89.99 MiB holds 2032 tokens" in result.stderr and "at least --kv-cache 90MiB" in result.stderr


def test_plan_json_carries_the_fixes_the_text_lists(tmp_path):
    text = invoke(["--kv-cache", "5GiB"], tmp_path)
    assert text.exit_code == 1, text.output
    assert "  --kv-cache 5.00 GiB → 3990 MiB\n" in text.stdout and "  --kv-cache unset: the plan sizes" in text.stdout
    as_json = invoke(["--kv-cache", "5GiB", "--json"], tmp_path)
    plan = json.loads(as_json.stdout)
    assert not plan["fits"]
    fixes = [(s["flag"], s["current"], s["proposed"]) for s in plan["suggestions"]]
    assert fixes == [("--kv-cache", "5.00 GiB", "3990 MiB"), ("--kv-cache", "5.00 GiB", "unset")], plan["suggestions"]
    assert all(s["saves_bytes"] >= plan["shortfall_bytes"] for s in plan["suggestions"]), plan
