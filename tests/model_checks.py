"""Checks shared by the dense, mixture-of-experts and hybrid model tests: our decoder
over the paged KV cache against transformers' logits for the same token ids, and greedy
runs through a paged runner or the engine."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import INTERPRETING

# The tiny models' vocabulary (``make_tiny_hf_model``'s default) and the greedy ids of a
# run, for the modules that compare whole families with transformers.
VOCAB = 256
STEPS = 16


def tiny_pair(kind: str, path, make_tiny_hf_model, vocab: int):
    """A tiny random transformers model of ``kind`` saved to ``path`` and ours loaded from
    it (float32, CPU): ``(kind, hf, ours, config, path)``."""
    from engine.loader.load import load_model

    hf = make_tiny_hf_model(kind, path, vocab_size=vocab)
    ours, config = load_model(path, "cpu", torch.float32)
    return kind, hf, ours, config, path


def pair_fixture(kinds: list[str], vocab: int):
    """A module-scoped fixture of :func:`tiny_pair`, one parameter per kind of ``kinds``
    (in a temporary folder of its name); assign it to the module's ``pair``."""

    @pytest.fixture(scope="module", params=kinds)
    def pair(request, tmp_path_factory, make_tiny_hf_model):
        return tiny_pair(request.param, tmp_path_factory.mktemp(request.param), make_tiny_hf_model, vocab)

    return pair


def two_prompts(vocab: int, low: int) -> dict[str, list[int]]:
    """Prompts ``"a"`` (9 ids) and ``"b"`` (5 ids) drawn from ``[low, vocab)``, seed 5."""
    gen = torch.Generator().manual_seed(5)
    return {"a": torch.randint(low, vocab, (9,), generator=gen).tolist(),
            "b": torch.randint(low, vocab, (5,), generator=gen).tolist()}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' ``[T, V]`` float32 logits of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy ids after ``ids``, on the model's device."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return gen[0, len(ids):].tolist()


def agreeing_prefix(ours: list[int], ref: list[int]) -> int:
    """How many leading ids of two equally long greedy runs are equal."""
    return next((j for j, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), len(ours))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    diff = float((ours - ref).abs().max())
    assert diff <= tol, f"max |diff| {diff:.3g} > {tol:.3g}"


def check_extend_and_decode(hf, runner, vocab: int) -> None:
    """Prefill 7 tokens, extend by 5 through the KV cache, then decode 3 one by one."""
    ids = torch.randint(0, vocab, (15,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, ids)
    assert_close(runner.step({0: ids[:7]})[0], ref[6])
    assert_close(runner.step({0: ids[7:12]})[0], ref[11])
    for i in range(12, 15):
        assert_close(runner.step({0: [ids[i]]})[0], ref[i])


def check_ragged_batch(hf, runner, vocab: int) -> None:
    """Two sequences of different lengths share every step (continuous batching), in
    an order that differs from the pool's in the second step."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, vocab, (9,), generator=gen).tolist()
    b = torch.randint(0, vocab, (6,), generator=gen).tolist()
    first = runner.step({"a": a[:5], "b": b[:2]})
    assert_close(first[0], hf_logits(hf, a[:5])[-1])
    assert_close(first[1], hf_logits(hf, b[:2])[-1])
    second = runner.step({"b": b[2:], "a": a[5:]})
    assert_close(second[0], hf_logits(hf, b)[-1])
    assert_close(second[1], hf_logits(hf, a)[-1])


def paged_greedy(runner, prompts: dict, steps: int, on_step=None) -> tuple[dict, torch.Tensor]:
    """Prefill every prompt (key -> ids) in one step of ``runner`` (a ``PagedRunner``),
    then ``steps`` batched greedy decode steps; ``on_step(i)`` runs before decode step
    ``i``. Returns (key -> greedy ids, the last step's ``[B, V]`` logits)."""
    out = {k: [] for k in prompts}
    logits = runner.step(prompts)
    for i in range(steps):
        nxt = {k: [int(logits[j].argmax())] for j, k in enumerate(prompts)}
        for k, t in nxt.items():
            out[k].append(t[0])
        if on_step is not None:
            on_step(i)
        logits = runner.step(nxt)
    return out, logits


def halved_cache_run(runner, prompts: dict, steps: int, model, config) -> tuple[dict, torch.Tensor, list[int]]:
    """:func:`paged_greedy` over ``runner`` (a ``PagedRunner`` of ``model``, whose MoE
    layers' experts are offloaded first with every expert cached, copies always
    preferred), the expert cache halved by a live replan before decode step 10 and grown
    back before step 20. Returns (ids, last logits, the cache's slots at each step)."""
    from engine.layers.moe.expert_costs import ALWAYS_COPY
    from engine.layers.moe.offload import offload_experts, resize_cache

    full = config.num_experts * len(config.moe_layers)
    stores, _ = offload_experts(model, config.moe_layers, config.num_experts, ALWAYS_COPY)
    sizes = []

    def replan(i: int) -> None:
        if i == 10:
            resize_cache(stores, full // 2)
        if i == 20:
            resize_cache(stores, full)
        sizes.append(sum(s.num_slots for s in stores))

    ids, logits = paged_greedy(runner, prompts, steps, replan)
    assert sizes[9] == full and sizes[10] == full // 2 and sizes[-1] == full
    assert all(len(s.slot_of) <= s.num_slots for s in stores)
    return ids, logits, sizes


def engine_greedy(config, prompts: dict, max_new_tokens: int, on_step=None):
    """An ``Engine`` of ``config`` (an ``EngineConfig``) given every prompt (key -> ids)
    as a greedy request of ``max_new_tokens`` tokens, stepped until done;
    ``on_step(engine, i)`` runs before step ``i`` (from 1). Returns (the engine, key ->
    generated ids)."""
    from engine.core.engine import Engine
    from engine.wire.messages import GenerateRequest, SamplingParams

    engine = Engine(config)
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for name, ids in prompts.items():
        engine.add_request(GenerateRequest(request_id=name, prompt_token_ids=ids, sampling=sp))
    out = {name: [] for name in prompts}
    steps = 0
    while engine.has_work():
        steps += 1
        if on_step is not None:
            on_step(engine, steps)
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return engine, out


def cuda_engine_agreement(folder, hf, steps: int) -> list[tuple[list[int], list[int], int]]:
    """The engine on CUDA (float32, 256 MiB of KV cache) over ``folder`` decodes three
    prompts of 5, 21 and 70 random ids below 512 together, ``steps`` greedy ids each;
    returns per prompt (its ids, ours, how many leading ids equal ``hf``'s greedy ones)."""
    from test_engine import run_all

    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.wire.messages import SamplingParams

    engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="float32", kv_cache=256 << 20))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 21, 70)]
    sp = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    out = run_all(engine, {str(i): (ids, sp) for i, ids in enumerate(prompts)})
    return [(ids, out[str(i)], agreeing_prefix(out[str(i)], hf_greedy(hf, ids, steps))) for i, ids in enumerate(prompts)]


def seeded_prompts(vocab: int, *lengths: int) -> list[list[int]]:
    """Prompts of ``lengths`` random ids in ``[3, vocab)``, seed 1: the same ones on
    every call."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_params(steps: int):
    """``SamplingParams`` of ``steps`` greedy ids, EOS ignored."""
    from engine.wire.messages import SamplingParams

    return SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)


def cpu_engine(path, **knobs):
    """An ``Engine`` of the model at ``path`` on the CPU, 128 pages of 4 tokens;
    ``knobs``: more ``EngineConfig`` fields."""
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine

    return Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=128, **knobs))


def check_engine_greedy(hf, path, vocab: int, steps: int, length: int) -> None:
    """A prompt of ``length`` seeded ids (:func:`seeded_prompts`) through
    :func:`cpu_engine` of ``path`` decodes the ``steps`` greedy ids transformers' ``hf``
    does."""
    from test_engine import run_all

    (ids,) = seeded_prompts(vocab, length)
    assert run_all(cpu_engine(path), {"q": (ids, greedy_params(steps))})["q"] == hf_greedy(hf, ids, steps)


def check_greedy_engine_runs(hf, path, vocab: int, steps: int) -> None:
    """``steps`` greedy ids through :func:`cpu_engine` engines of ``path`` equal
    transformers' (``hf``) for seeded prompts of 24, 5 and 37 ids: the first alone, all
    three batched, and the last in prefill chunks of 8 and of 5 tokens (each chunk's
    sliding window reaching back into the last)."""
    from test_engine import run_all

    prompts, sampling = seeded_prompts(vocab, 24, 5, 37), greedy_params(steps)
    want = [hf_greedy(hf, ids, steps) for ids in prompts]
    assert run_all(cpu_engine(path), {"r0": (prompts[0], sampling)})["r0"] == want[0]
    together = run_all(cpu_engine(path), {f"r{i}": (ids, sampling) for i, ids in enumerate(prompts)})
    assert [together[f"r{i}"] for i in range(len(prompts))] == want
    for chunk in (8, 5):
        assert run_all(cpu_engine(path, max_prefill_tokens=chunk), {"c": (prompts[-1], sampling)})["c"] == want[-1]


def check_prefix_cache_hit(hf, path, vocab: int, steps: int, **knobs) -> None:
    """A seeded prompt of 26 ids, then one of its first 20 ids and 6 others, through one
    :func:`cpu_engine` of ``path`` (``knobs``: more ``EngineConfig`` fields): the second
    reuses whole pages of the shared prefix and both decode ``steps`` greedy ids as
    transformers (``hf``) does from scratch."""
    from test_engine import run_all

    engine, sampling, shared = cpu_engine(path, **knobs), greedy_params(steps), 20
    first, tail = seeded_prompts(vocab, 26, 6)
    second = first[:shared] + tail
    assert engine.radix is not None
    assert run_all(engine, {"a": (first, sampling)})["a"] == hf_greedy(hf, first, steps)
    hits = engine.radix.hit_tokens
    assert run_all(engine, {"b": (second, sampling)})["b"] == hf_greedy(hf, second, steps)
    page = engine.config.page_size
    assert engine.radix.hit_tokens - hits >= shared // page * page


def check_attention_step(windows: tuple[int, int], eager, *, softcap: float = 0.0, sinks=None,
                         backend: str = "torch") -> None:
    """The attention ``backend`` (``triton``: on CPU tensors, under Triton's interpreter)
    with two pool layers of ``windows`` (0: the whole context), scores capped at
    ``softcap``, ``sinks`` per head or None, against ``eager(q, k, v, mask)``
    (transformers' eager attention of one sequence, ``[1, H, E, D]`` queries, ``[1, H_kv,
    S, D]`` keys and values, an additive ``[1, 1, E, S]`` mask; ``[1, E, H, D]`` back) on
    one step: a 4-token chunk over a 13-token cached prefix, a decode row at position 9
    and a first chunk of 6 tokens."""
    from engine.common.forward_batch import ForwardBatch
    from engine.kvcache.pool import KVPool
    from engine.layers.attention.registry import create_attention_backend

    if backend == "triton":
        pytest.importorskip("triton")
        if not INTERPRETING:
            pytest.skip("the step's tensors are on the CPU: Triton runs them interpreted only")
    heads, kv_heads, dim, ps, scale = 4, 2, 8, 4, 0.3
    pool = KVPool(num_layers=2, num_pages=16, page_size=ps, num_kv_heads=kv_heads, head_dim=dim,
                  dtype=torch.float32, device="cpu")
    attn = create_attention_backend(backend, pool, num_heads=heads, head_dim=dim, scale=scale)
    attn.use_windows(windows, softcap)
    g = torch.Generator().manual_seed(0)
    lens, prefix = {"a": 17, "b": 10, "c": 6}, {"a": 13, "b": 9, "c": 0}
    pages = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9], "c": [10, 11]}
    kv = {s: [torch.randn(n, kv_heads, dim, generator=g) for _ in range(4)] for s, n in lens.items()}  # k, v per layer
    q = {s: torch.randn(lens[s] - prefix[s], heads, dim, generator=g) for s in lens}

    def slots(s: str, pos) -> torch.Tensor:
        return torch.tensor([pages[s][p // ps] * ps + p % ps for p in pos])

    for s in lens:  # the cached prefix, and this step's tokens too (kv_stored)
        for layer in (0, 1):
            pool.store(layer, slots(s, range(lens[s])), kv[s][2 * layer], kv[s][2 * layer + 1])
    new = {s: range(prefix[s], lens[s]) for s in lens}
    batch = ForwardBatch(
        is_decode=False, input_ids=torch.zeros(11, dtype=torch.int64),
        positions=torch.tensor([p for s in lens for p in new[s]]),
        out_slots=torch.cat([slots(s, new[s]) for s in lens]),
        page_table=torch.tensor([p + [0] * (5 - len(p)) for p in pages.values()]),
        prefix_lens=torch.tensor(list(prefix.values())), extend_lens=torch.tensor([4, 1, 6]),
        logits_indices=torch.tensor([3, 4, 10]))
    attn.prepare(batch)
    for layer, window in enumerate(windows):
        got = attn.forward(torch.cat(list(q.values())), None, None, layer, batch, kv_stored=True, sinks=sinks)
        want = []
        for s in lens:
            q_pos, k_pos = torch.tensor(new[s])[:, None], torch.arange(lens[s])[None, :]
            seen = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
            mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None]
            k, v = (t.transpose(0, 1)[None] for t in kv[s][2 * layer : 2 * layer + 2])
            want.append(eager(q[s].transpose(0, 1)[None], k, v, mask, scale)[0].reshape(len(new[s]), heads * dim))
        torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)

