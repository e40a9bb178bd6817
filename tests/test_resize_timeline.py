"""The simulated VRAM watcher and the replan controller drive a real engine on the CPU: a
scripted desktop (a game takes 40% of the card, a browser spikes, both leave) resizes
the KV pool under a stream of requests, and no request fails.
"""

from __future__ import annotations

import torch
from resize_runs import carry_out, make_engine, pool_state, serve

from engine.wire.messages import REPLAN_RESIZE_POOL, Replanned, SamplingParams

# -- the watcher and the controller drive a real engine ------------------------------------


def _stream(seed: int, n: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    """``n`` requests, two arriving every four steps: (step, id, prompt, sampling)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (8,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(
            3, 256, (int(torch.randint(8, 36, (1,), generator=g)),), generator=g
        ).tolist()
        prompt = (shared + tail) if i % 3 == 0 else tail
        sp = SamplingParams(
            max_new_tokens=int(torch.randint(12, 28, (1,), generator=g)),
            temperature=0.0,
            ignore_eos=True,
        )
        out.append((4 * (i // 2), f"q{i}", prompt, sp))
    return out


def test_a_desktop_timeline_drives_live_resizes_and_no_request_fails(tiny_dir):
    """The scripted desktop (a game takes 40% of the card, a browser spikes, both leave)
    seen through the simulated watcher, the replan controller deciding, the engine
    resizing its pool under a stream of requests: no request fails, every output equals
    the undisturbed run, the pool follows the timeline, and the decisions do not flap."""
    from service.vram.replan import (
        NewPoolSize,
        ReplanController,
    )
    from service.vram.simulated import SimulatedSource


    planned = 204
    stream = _stream(7, 40)
    ref_out, ref_final = serve(make_engine(tiny_dir, num_pages=planned), stream)

    engine = make_engine(tiny_dir, num_pages=planned)
    KiB = 1 << 10
    page = engine.kv_page_bytes
    # A desktop card in miniature: weights and the rest, the pool, the desktop, the
    # reserve and the plan's safety margin, which is the headroom at the start.
    fixed, desktop, reserve, margin = 128 * KiB, 64 * KiB, 64 * KiB, 16 * KiB
    total = fixed + engine.pool.nbytes + desktop + reserve + margin
    game, browser = int(0.4 * total), 100 * KiB
    dt = 0.25  # seconds per step

    def others(t: float) -> int:
        # The game loads for two seconds from t=3, plays, and quits at t=15; the browser
        # spikes at t=8 for two seconds.
        loading = min(max((t - 3) / 2, 0.0), 1.0) if t < 15 else 0.0
        return desktop + int(game * loading) + (browser if 8 <= t < 10 else 0)

    source = SimulatedSource(total, others, ours_bytes=lambda: fixed + engine.pool.nbytes)
    ctl = ReplanController(
        low_water_bytes=4 * KiB, high_water_bytes=40 * KiB, hold_s=2.0, reserve=reserve
    )
    pages_over_time = []

    def on_step(n, e):
        s = source.sample(at=n * dt)
        carry_out(e, ctl.decide(s, pool_state(e, planned)))
        pages_over_time.append((n * dt, e.pool.num_pages))

    out, final = serve(engine, stream, on_step=on_step)
    assert out == ref_out
    assert all(f.finish_reason == "length" for f in final.values())
    assert engine.stats().failed == 0

    resizes = [
        ev
        for ev in engine.drain_events()
        if isinstance(ev, Replanned) and ev.action == REPLAN_RESIZE_POOL
    ]
    assert len(resizes) == ctl.shrinks + ctl.grows
    signs = []
    for ev in resizes:
        sign = "+" if ev.after_pages > ev.before_pages else "-"
        if not signs or signs[-1] != sign:
            signs.append(sign)
    assert signs == ["-", "+"], "the pool went down with the desktop and came back up"
    # Shrinks only while the game loaded (at most one per sample: it kept taking) and at
    # the browser's spike; one grow after each left, each after the hold.
    shrunk_at = [
        d.timestamp
        for d in ctl.decisions
        for a in d.actions
        if isinstance(a, NewPoolSize) and not a.grows
    ]
    grown_at = [
        d.timestamp
        for d in ctl.decisions
        for a in d.actions
        if isinstance(a, NewPoolSize) and a.grows
    ]
    assert all(3 <= t < 5.5 or 8 <= t < 8.75 for t in shrunk_at), shrunk_at
    assert len(grown_at) == 2 and grown_at[0] >= 10 + 2.0 and grown_at[1] >= 15 + 2.0

    def pages_at(t):
        return next(p for tt, p in pages_over_time if tt >= t)

    assert pages_at(2.5) == planned
    during_game = pages_at(7.5)
    assert during_game <= planned - (game - reserve) // page
    assert pages_at(9.5) < during_game, "the browser's spike took more"
    assert pages_at(9.5) >= engine.min_kv_pool_pages()
    assert pages_at(12.5) > pages_at(9.5), "the browser's share came back"
    assert engine.pool.num_pages == planned, "grown back once both left"
    assert engine.info.max_context_tokens == 128
