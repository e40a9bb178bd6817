"""``headroom bench engine`` on the CPU, small: both sides run the same cases and the
table ends with the resident-memory lines (figures are measured, never asserted)."""

from __future__ import annotations

import pytest

from engine.bench.speed import run_bench_engine


@pytest.mark.parametrize("transformers_side", [True, False])
def test_bench_engine_runs_both_sides_on_the_cpu(default_model_dir, capsys, transformers_side):
    rows = run_bench_engine(model=None, device="cpu", batches=(1, 2), prompt_tokens=8, new_tokens=3,
                            long_prefill_tokens=0, transformers_side=transformers_side)
    sides = {(r["batch"], r["side"]) for r in rows}
    want = {"headroom", "transformers", "ratio"} if transformers_side else {"headroom"}
    assert sides == {(b, s) for b in (1, 2) for s in want}
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    # The engine's rows carry its own peak (before transformers loads) and the KV cache
    # each case fills: batch x (prompt + new tokens) x the pool's bytes per token.
    ours = [r for r in rows if r["side"] == "headroom"]
    assert all(r["peak_rss_mib"] > 0 for r in ours)
    assert ours[1]["kv_mib"] == pytest.approx(2 * ours[0]["kv_mib"])
    out = capsys.readouterr().out
    assert "on cpu (float32)" in out
    assert "peak RSS of the engine alone" in out
    assert ("peak RSS with transformers' model too" in out) == transformers_side
