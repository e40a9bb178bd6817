"""Sliding-window layers that keep only their window (``--sliding-kv-ring``,
:mod:`engine.kvcache.ring`): greedy ids equal transformers' (eager attention) for prompts
several windows long (window 8, pages of 4 tokens) alone, batched, in prefill chunks,
after a preemption and after a prefix-cache hit (the ring's last window restored from a
checkpoint); each running request holds min(its pages, R) ring pages and the ring pool
lends no others; the pool's resize leaves the ring alone; the plan prices the sliding
layers' ring pool at min(requests x R + checkpoints' pages, P) pages and the others per
token (lazy growth itself: tests/test_sliding_kv_ring_growth.py)."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import (
    STEPS,
    VOCAB,
    cpu_engine,
    greedy_params,
    hf_greedy,
    pair_fixture,
    seeded_prompts,
)
from test_engine import run_all

from engine.core.footprint import kv_bytes_per_token, kv_ring, make_footprint
from engine.kvcache.pool import KVPool
from engine.kvcache.ring import SlidingRing, ring_row, sliding_ring
from engine.memory.ledger import make_plan
from engine.memory.plan import DeviceMemory, PlanKnobs
from engine.wire.messages import GenerateRequest

pytest.importorskip("transformers")

pair = pair_fixture(["gemma3", "gemma4", "gpt_oss"], VOCAB)


def ring_engine(path, **knobs):
    """:func:`cpu_engine` with ``--sliding-kv-ring`` (``num_pages`` replaces its 128)."""
    if "num_pages" in knobs:
        from engine.common.config import EngineConfig
        from engine.core.engine import Engine

        return Engine(EngineConfig(model=str(path), device="cpu", page_size=4, sliding_kv_ring="on", **knobs))
    return cpu_engine(path, sliding_kv_ring="on", **knobs)


def interpreted_triton(engine, config, max_batch: int):
    """The Triton backend (which CUDA graphs capture) over ``engine``'s pool, for CPU
    tensors under Triton's interpreter; skips the test where it does not interpret."""
    from triton_interpret import INTERPRETING

    from engine.layers.attention.registry import model_attention

    pytest.importorskip("triton")
    if not INTERPRETING:
        pytest.skip("the step's tensors are on the CPU: Triton runs them interpreted only")
    return model_attention("triton", engine.pool, config, max_batch)


def test_greedy_ids_equal_transformers_alone_batched_and_chunked(pair):
    """A prompt of 45 ids (over five windows) alone; three prompts batched; the longest in
    chunks of 8 and of 5 tokens, each chunk's window reaching back into the ring."""
    _, hf, _, config, path = pair
    prompts, sampling = seeded_prompts(VOCAB, 45, 5, 29), greedy_params(STEPS)
    want = [hf_greedy(hf, ids, STEPS) for ids in prompts]
    engine = ring_engine(path, max_prefill_tokens=16)  # rings of 7 pages: 28 tokens, so each wraps
    assert engine.pool.ring_layers == {i for i, w in enumerate(config.kv_windows) if w}
    assert run_all(engine, {"r0": (prompts[0], sampling)})["r0"] == want[0]
    together = run_all(ring_engine(path, max_prefill_tokens=16), {f"r{i}": (ids, sampling) for i, ids in enumerate(prompts)})
    assert [together[f"r{i}"] for i in range(len(prompts))] == want
    for chunk in (8, 5):
        chunked = ring_engine(path, max_prefill_tokens=chunk)
        assert chunked.ring.ring.pages == math.ceil((8 + chunk - 1) / 4) + 1
        assert run_all(chunked, {"c": (prompts[0], sampling)})["c"] == want[0]


def test_ring_pool_holds_one_ring_per_running_request(pair):
    """Three requests decoding 40 tokens past a 30-token prompt, the third aborted on
    the way: between steps each running request holds min(its pages, D) ring pages (its
    ring grew with its pages, then wrapped; a prefill step's larger ring went back to D)
    and the ring pool lends no others (its checkpoints apart); all come back at the end,
    the global pages to the prefix cache."""
    _, _, _, _, path = pair
    engine = ring_engine(path, max_prefill_tokens=8, max_running_requests=3)
    ring = engine.ring
    per_request = ring.ring.decode_pages
    assert per_request == math.ceil(8 / 4) + 1 and ring.ring.pages == math.ceil((8 + 7) / 4) + 1
    # 3 rings between steps, a chunk's 2 pages and one each for the items of a step, and 3 checkpoints
    assert ring.allocator.num_usable == 3 * per_request + 2 + 3 + 3 * ring.ring.checkpoint_pages
    for i, ids in enumerate(seeded_prompts(VOCAB, 30, 30, 30)):
        engine.add_request(GenerateRequest(request_id=f"q{i}", prompt_token_ids=ids, sampling=greedy_params(40)))
    steps, most, short = 0, 0, 0
    while engine.has_work():
        engine.step()
        if steps == 12:
            engine.abort("q2")  # its ring goes back at once
            assert not any(r.request_id == "q2" for r in engine.scheduler.running)
        running = engine.scheduler.running
        assert all(len(r.ring) == min(len(r.pages), per_request) for r in running)
        short += sum(len(r.ring) < per_request for r in running)
        held = sum(len(r.ring) for r in running)
        assert len({p for r in running for p in r.ring}) == held
        assert ring.allocator.num_free == ring.allocator.num_usable - held - ring.checkpoint_pages_held
        most, steps = max(most, len(running)), steps + 1
    assert most == 3 and steps > 40 and engine.scheduler.aborted_count == 1 and short > 0
    assert ring.allocator.num_free + ring.checkpoint_pages_held == ring.allocator.num_usable
    assert engine.allocator.num_free + engine.radix.evictable_pages() == engine.allocator.num_usable


def test_preempted_request_recomputes_its_ring(pair):
    """A global pool of 24 pages of 4 tokens cannot hold three requests growing to 50
    tokens: the youngest is preempted (its ring given back) and recomputed from its
    prompt and output, and every output equals transformers'."""
    _, hf, _, _, path = pair
    prompts, sampling = seeded_prompts(VOCAB, 30, 26, 22), greedy_params(20)
    engine = ring_engine(path, num_pages=25, max_prefill_tokens=16)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"p{i}", prompt_token_ids=ids, sampling=sampling))
    out = {f"p{i}": [] for i in range(3)}
    preempted = set()
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        preempted |= {r.request_id for r in engine.scheduler.waiting if r.output_ids}
        assert all(not r.ring for r in engine.scheduler.waiting)
    assert preempted
    assert [out[f"p{i}"] for i in range(3)] == [hf_greedy(hf, ids, 20) for ids in prompts]
    assert engine.ring.allocator.num_free + engine.ring.checkpoint_pages_held == engine.ring.allocator.num_usable


def test_prefix_cache_hit_restores_the_window_and_equals_a_cold_run(pair):
    """A second prompt sharing 24 ids with the first, then a third continuing the first's
    prompt and answer (an agent's next turn): each starts from a cached prefix whose
    sliding layers' last window comes back from a ring checkpoint, and decodes as
    transformers does from scratch."""
    _, hf, _, _, path = pair
    engine, sampling = ring_engine(path, max_prefill_tokens=16), greedy_params(STEPS)
    first, tail, more = seeded_prompts(VOCAB, 34, 7, 5)
    second = first[:24] + tail
    answer = run_all(engine, {"a": (first, sampling)})["a"]
    assert answer == hf_greedy(hf, first, STEPS)
    rings = engine.scheduler.prefix_states
    assert rings.saved > 0
    assert run_all(engine, {"b": (second, sampling)})["b"] == hf_greedy(hf, second, STEPS)
    assert rings.restored == 1 and engine.radix.hit_tokens >= 16
    hits = engine.radix.hit_tokens
    third = first + answer + more
    assert run_all(engine, {"c": (third, sampling)})["c"] == hf_greedy(hf, third, STEPS)
    assert rings.restored == 2 and engine.radix.hit_tokens - hits >= 44  # up to the first's last whole page
    assert engine.ring.allocator.num_free + engine.ring.checkpoint_pages_held == engine.ring.allocator.num_usable


def test_without_the_option_nothing_changes(pair):
    """``--sliding-kv-ring off``: one pool of every layer, no ring, the prefix cache on
    without checkpoints."""
    _, _, _, config, path = pair
    engine = cpu_engine(path, sliding_kv_ring="off")
    assert engine.ring is None and not engine.pool.ring_layers and engine.radix.release_state is None
    assert engine.scheduler.prefix_states is None
    assert engine.pool.nbytes == engine.pool.page_bytes * 128
    assert engine.info.kv_bytes_per_token == kv_bytes_per_token(config, torch.float32)


def test_ring_geometry_and_table():
    assert sliding_ring((8, 8, 0), max_chunk=5, page_size=4) == SlidingRing((0, 1), 8, 5, 4)
    assert sliding_ring((8, 8), max_chunk=5, page_size=4) is None  # every layer slides: no ring
    assert sliding_ring((0, 0), max_chunk=5, page_size=4) is None
    ring = SlidingRing((0,), 8, 5, 4)
    assert ring.pages == 4 and ring.decode_pages == 3 and ring.checkpoint_pages == 2
    assert ring.pages_for(1) == 3 and ring.pages_for(2) == 4 and ring.pages_for(0) == 3
    assert ring.rings_bound(3) == 3 * 3 + 2 + 3 and ring.rings_bound(0) == 0 and ring.pool_pages(3) == 15
    assert ring.pool_pages(3, 2) == 19 and ring.pool_pages(3, 2, global_pages=12) == 13  # at most the global pages
    assert ring_row([7, 3], 2).tolist() == [7, 3]  # a ring still growing: page j is its j-th
    assert ring_row([7, 3, 9], 7).tolist() == [7, 3, 9, 7, 3, 9, 7]
    with pytest.raises(ValueError, match="max_chunk"):
        sliding_ring((8, 0), max_chunk=0, page_size=4)


def test_pool_resize_leaves_the_ring_buffers():
    pool = KVPool(num_layers=3, num_pages=6, page_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device="cpu", ring_layers=(0, 2), ring_pages=5)
    ring_k = pool.k_buffers[0]
    pool.k_buffers[0][4:8] = 1.0
    pool.k_buffers[1][4:8] = 2.0
    pool.resize(9)
    assert pool.num_pages == 9 and pool.k_buffers[1].shape[0] == 36 and pool.k_buffers[1][4:8].eq(2.0).all()
    assert pool.k_buffers[0] is ring_k and pool.k_buffers[2].shape[0] == 20
    pool.copy_pages([1], [8])
    assert pool.k_buffers[1][32:36].eq(2.0).all() and pool.k_buffers[0][4:8].eq(1.0).all()
    assert pool.page_bytes == 2 * 4 * 4 * 4  # one layer's keys and values per page
    with pytest.raises(ValueError, match="not all"):
        KVPool(num_layers=2, num_pages=6, page_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32,
               device="cpu", ring_layers=(0, 1), ring_pages=5)


def test_plan_prices_global_layers_per_token_and_sliding_layers_at_their_rings(pair):
    """A tiny Gemma 3 (4 of 6 layers slide over 8 tokens): the KV pool's P pages hold the
    2 global layers, and the ring pool min(B x D + a chunk's pages + B + checkpoints'
    pages, P) pages of the 4 sliding ones and its null page, D = ceil(8 / 4) + 1. On a
    card whose P is
    below that bound (a short context) the KV costs what ``--sliding-kv-ring off``
    prices, every layer per token; on a large one (a long context) far less, so the same
    budget holds 2.9x the tokens. For the same pages it is never above the off plan's
    (its null page apart, which the off plan's pool holds too, unpriced)."""
    kind, _, _, config, _ = pair
    if kind != "gemma3":
        pytest.skip("the prices are checked on Gemma 3's layer mix")
    per_layer = 2 * config.num_kv_heads * config.head_dim * 4  # float32 keys and values
    common = dict(page_size=4, max_prefill_tokens=64, max_running_requests=4, max_model_len=None, reserve=0,
                  safety_margin_bytes=0)
    knobs, off_knobs = PlanKnobs(**common, sliding_kv_ring="auto"), PlanKnobs(**common, sliding_kv_ring="off")
    ring = kv_ring(config, knobs)
    assert ring is not None and ring.pages == math.ceil((8 + 63) / 4) + 1 and kv_ring(config, off_knobs) is None
    fp, off_fp = make_footprint(config, torch.float32, knobs), make_footprint(config, torch.float32, off_knobs)
    assert fp.kv_bytes_per_token == 2 * per_layer and off_fp.kv_bytes_per_token == 6 * per_layer
    assert "of up to 3 pages" in fp.kv_window_note and "19 in a step of a whole prefill chunk" in fp.kv_window_note
    assert ring.checkpoint_pages == 2 and knobs.state_checkpoints == 4
    g, s, cap = 4 * 2 * per_layer, 4 * 4 * per_layer, 4 * 3 + 64 // 4 + 4 + 4 * 2

    def card(total: int) -> DeviceMemory:
        return DeviceMemory(name="sim", total_bytes=total, free_bytes=total, others_bytes=0, simulated=True)

    def kv(plan) -> int:  # the KV pool's and the rings' lines
        return plan.kv_pool_bytes + sum(e.bytes for e in plan.ledger if e.name == "sliding-window KV rings")

    large = make_plan(card(1 << 30), knobs, fp)
    assert large.num_pages > cap and kv(large) == large.num_pages * g + (cap + 1) * s
    base = large.fixed_bytes - cap * s  # all but the rings, their null page in it
    small = make_plan(card(base + 30 * (g + s)), knobs, fp)
    assert small.num_pages == 30 and kv(small) == 30 * g + (30 + 1) * s
    assert "as many as the KV pool's 30 pages, fewer than the 40 of the rings of 4 requests (32 pages)" in next(
        e.source for e in small.ledger if e.name == "sliding-window KV rings")
    for plan, total in ((small, base + 30 * (g + s)), (large, 1 << 30)):
        off = make_plan(card(total), off_knobs, off_fp)
        assert plan.num_pages >= off.num_pages
        assert off.num_pages * g + (min(off.num_pages, cap) + 1) * s <= off.kv_pool_bytes + s
    assert small.num_pages == make_plan(card(base + 30 * (g + s)), off_knobs, off_fp).num_pages
    assert large.num_pages > 2.9 * make_plan(card(1 << 30), off_knobs, off_fp).num_pages


def test_cpu_plan_shows_the_rings(pair):
    """``headroom plan`` on the CPU: the rings on a row of their own, the KV per token
    over the global layers."""
    from engine.commands.plan import cpu_holdings, render_cpu
    from engine.common.config import EngineConfig

    kind, _, _, config, path = pair
    if kind != "gemma3":
        pytest.skip("the prices are checked on Gemma 3's layer mix")
    per_layer = 2 * config.num_kv_heads * config.head_dim * 4
    h = cpu_holdings(EngineConfig(model=str(path), device="cpu", page_size=4, max_prefill_tokens=64,
                                  max_running_requests=4, sliding_kv_ring="on"))
    assert h.kv_ring_window_pages == 3 and h.kv_ring_pages == 4 * 3 + 16 + 4 + 4 * 2  # 4 rings, a chunk, checkpoints
    assert h.kv_ring_bytes == (1 + h.kv_ring_pages) * 4 * 4 * per_layer
    assert h.kv_bytes_per_token == 2 * per_layer
    assert "sliding-window KV rings" in render_cpu(h, as_json=False)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_reads_the_ring_as_the_whole_context(backend, decode):
    """One step of a 4-token chunk over a 19-token prefix, a decode row at position 13
    and a first chunk of 4, or (``decode``) a decode row of each of the three (window
    5, chunks up to 4: rings of 3 pages of 4 tokens),
    every position written into the ring in order as the engine would (older ones
    overwritten): the sliding layer's output equals that of a pool that keeps every
    token, and so does the global layer's (Triton's kernels under its interpreter)."""
    from triton_interpret import INTERPRETING

    from engine.common.forward_batch import ForwardBatch
    from engine.layers.attention.registry import create_attention_backend

    if backend == "triton":
        pytest.importorskip("triton")
        if not INTERPRETING:
            pytest.skip("the step's tensors are on the CPU: Triton runs them interpreted only")
    heads, kv_heads, dim, ps, windows = 4, 2, 8, 4, (5, 0)
    ring = sliding_ring(windows, max_chunk=4, page_size=ps)
    assert ring is not None and ring.pages == 3
    lens, prefix = [23, 14, 4], [22, 13, 3] if decode else [19, 13, 0]
    pages = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [11]]
    rings = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    g = torch.Generator().manual_seed(0)
    kv = [[torch.randn(n, kv_heads, dim, generator=g) for _ in range(4)] for n in lens]  # k, v per layer
    q = torch.randn(sum(n - p for n, p in zip(lens, prefix, strict=True)), heads, dim, generator=g)
    new = [range(p, n) for n, p in zip(lens, prefix, strict=True)]

    def slots(table: list[int], pos) -> torch.Tensor:
        return torch.tensor([table[p // ps] * ps + p % ps for p in pos])

    tables = [ring_row(r, len(p)).tolist() for r, p in zip(rings, pages, strict=True)]
    out = {}
    for kind in ("full", "ring"):
        pool = KVPool(num_layers=2, num_pages=16, page_size=ps, num_kv_heads=kv_heads, head_dim=dim,
                      dtype=torch.float32, device="cpu",
                      **(dict(ring_layers=ring.layers, ring_pages=ring.pool_pages(3)) if kind == "ring" else {}))
        attn = create_attention_backend(backend, pool, num_heads=heads, head_dim=dim, scale=0.3)
        attn.use_windows(windows)
        for s in range(3):  # in position order, so a ring keeps the last writes
            pool.store(0, slots(tables[s] if kind == "ring" else pages[s], range(lens[s])), kv[s][0], kv[s][1])
            pool.store(1, slots(pages[s], range(lens[s])), kv[s][2], kv[s][3])
        ring_fields = dict(ring_page_table=torch.tensor([t + [0] * (6 - len(t)) for t in tables]),
                           ring_out_slots=torch.cat([slots(tables[s], new[s]) for s in range(3)]))
        batch = ForwardBatch(
            is_decode=decode, input_ids=torch.zeros(len(q), dtype=torch.int64),
            positions=torch.tensor([p for r in new for p in r]),
            out_slots=torch.cat([slots(pages[s], new[s]) for s in range(3)]),
            page_table=torch.tensor([p + [0] * (6 - len(p)) for p in pages]),
            prefix_lens=torch.tensor(prefix), extend_lens=torch.tensor([n - p for n, p in zip(lens, prefix, strict=True)]),
            logits_indices=torch.tensor([0, 1, 2] if decode else [3, 4, 8]), **(ring_fields if kind == "ring" else {}))
        attn.prepare(batch)
        out[kind] = [attn.forward(q, None, None, layer, batch, kv_stored=True) for layer in (0, 1)]
    for layer in (0, 1):
        torch.testing.assert_close(out["ring"][layer], out["full"][layer], rtol=1e-5, atol=1e-5)


def test_decode_graph_inputs_carry_the_ring(pair):
    """The decode graphs' static batch (:class:`engine.core.cuda_graphs.DecodeGraphs`)
    filled for three decoding requests, padded to 4 rows, gives the logits of the eager
    batch: its ring slots and page table are the requests' (run eagerly here on the CPU
    through the Triton backend, which the graphs capture, under Triton's interpreter; the
    pinned buffers' constant sections written as the CUDA path keeps them)."""
    from engine.core.cuda_graphs import DecodeGraphs

    _, _, _, config, path = pair
    engine = ring_engine(path, max_prefill_tokens=8, max_running_requests=4)
    attn = interpreted_triton(engine, config, 4)
    for i, ids in enumerate(seeded_prompts(VOCAB, 30, 21, 13)):
        engine.add_request(GenerateRequest(request_id=f"g{i}", prompt_token_ids=ids, sampling=greedy_params(12)))
    while engine.has_work():
        engine.step()
        plan = engine.scheduler.schedule()
        if plan is None or not plan.is_decode or len(plan.items) < 3 or plan.items[0].req.kv_len < 30:
            if plan is not None:
                engine.scheduler.rollback(plan)
            continue
        graphs = DecodeGraphs(engine.model, attn, torch.device("cpu"), page_size=4, max_batch=4,
                              max_context_tokens=64, ring=True)
        assert graphs.ring and graphs.size_for(3) == 4
        graphs._fill(plan.items, 4)
        graphs._host_constants(graphs._dev.numpy())
        with torch.inference_mode():
            eager = engine.model(engine.runner.build_batch(plan), attn)
            static = engine.model(graphs._batches[4], attn)[:3]
        torch.testing.assert_close(static, eager)
        engine.scheduler.rollback(plan)
        return
    pytest.fail("no decode step of three requests past 30 tokens")


def test_live_pool_resize_keeps_the_rings(pair):
    """Two requests decoding while the pool shrinks to 40 pages and grows back to 128:
    the global layers' buffers move, the rings' do not, and both answers equal
    transformers'."""
    _, hf, _, _, path = pair
    engine = ring_engine(path, max_prefill_tokens=16, max_running_requests=2)
    prompts, sampling = seeded_prompts(VOCAB, 33, 27), greedy_params(20)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"z{i}", prompt_token_ids=ids, sampling=sampling))
    ring_buffers = [engine.pool.k_buffers[i] for i in sorted(engine.pool.ring_layers)]
    out, steps = {"z0": [], "z1": []}, 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        steps += 1
        if steps == 6:
            assert engine.resize_kv_pool(40).after_pages == 40 == engine.pool.num_pages
        if steps == 12:
            engine.resize_kv_pool(128)
    assert engine.pool.num_pages == 128
    assert all(engine.pool.k_buffers[i] is b for i, b in zip(sorted(engine.pool.ring_layers), ring_buffers,
                                                               strict=True))
    assert [out["z0"], out["z1"]] == [hf_greedy(hf, ids, 20) for ids in prompts]


def test_prefill_graph_inputs_carry_the_ring(pair):
    """The prefill graphs' static batch (:class:`engine.core.prefill_graphs.PrefillGraphs`)
    filled for the last chunk of a 44-token prompt (12 tokens padded to 16, the ring
    wrapped) gives the eager chunk's logits (Triton's backend under its interpreter, as
    the decode graphs' test)."""
    from engine.core.prefill_graphs import PrefillGraphs, write_inputs

    _, _, _, config, path = pair
    engine = ring_engine(path, max_prefill_tokens=16, max_running_requests=1)
    attn = interpreted_triton(engine, config, 1)
    (ids,) = seeded_prompts(VOCAB, 44)
    engine.add_request(GenerateRequest(request_id="p", prompt_token_ids=ids, sampling=greedy_params(2)))
    engine.step(), engine.step()
    plan = engine.scheduler.schedule()
    (item,) = plan.items
    assert (item.start, item.num_tokens) == (32, 12) and item.samples
    graphs = PrefillGraphs(engine.model, attn, torch.device("cpu"), page_size=4, max_tokens=16,
                           max_context_tokens=64, ring=True)
    assert graphs.size_for(plan.items) == 16
    write_inputs(graphs._dev.numpy(), item, 16, graphs.max_tokens, 4, graphs.width)
    with torch.inference_mode():
        static = engine.model(graphs._batches[16], attn)
        eager = engine.model(engine.runner.build_batch(plan), attn)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    engine.scheduler.rollback(plan)
